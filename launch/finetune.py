r"""Fine-tunes θ0 on one task in each configured regime and saves its task vectors
(`editing.jobs.finetune`).

  python -m launch.finetune --workdir=workdir/quickstart --task=digits \
      [--config.regimes=full,talos] [--config.finetune.steps=200]
  python -m launch.finetune --workdir=workdir/poisoned --task=digits \
      --config.poison.tasks=digits --config.poison.trigger=blended
"""

from absl import flags

from configs import quickstart as quickstart_config
from editing.data import suite
from editing.jobs import cli
from editing.jobs import finetune

if __name__ == '__main__':
  task = flags.DEFINE_enum('task', None, suite.DOWNSTREAM_TASKS, 'the task to fine-tune on')
  flags.mark_flag_as_required('task')
  cli.run(lambda config, workdir: finetune.run_regimes(config, workdir, task.value),
          quickstart_config)
