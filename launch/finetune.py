r"""Fine-tunes θ0 on one task in each configured regime and saves its task vectors
(`editing.jobs.finetune`).

  python -m launch.finetune --workdir=workdir/quickstart --task=digits \
      [--config.regimes=full,talos] [--config.finetune.steps=200]
  python -m launch.finetune --workdir=workdir/poisoned --task=digits \
      --config.poison.tasks=digits --config.poison.trigger=blended
  python -m launch.finetune --config=configs/text_quickstart.py --workdir=workdir/text --task=add
"""

from absl import flags

from configs import quickstart as quickstart_config
from editing.jobs import cli
from editing.jobs import finetune

if __name__ == '__main__':
  task = flags.DEFINE_string('task', None, 'the task to fine-tune on, one of the config\'s')
  flags.mark_flag_as_required('task')
  cli.run(lambda config, workdir: finetune.run_regimes(config, workdir, task.value),
          quickstart_config)
