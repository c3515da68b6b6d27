r"""Fine-tunes θ0 on one task of the suite, in the configured regime, and saves its task vector.

  python -m launch.finetune --workdir=workdir/quickstart --task=digits \
      [--config.finetune.regime=full] [--config.finetune.steps=200]
"""

import os

import ml_collections
from absl import app, flags, logging

from editing import checkpoint
from editing import regimes
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from editing.models import head as head_lib
from editing.task_vector import TaskVector
from launch import common


def run(config: ml_collections.ConfigDict, workdir: str, task_name: str) -> TaskVector:
  """Fine-tunes on `task_name` unless its task vector already exists; returns the vector."""
  regime = regimes.get(config.finetune.regime)
  out = common.task_vector_file(workdir, regime.name, task_name)
  directory = common.finetune_dir(workdir, regime.name, task_name)
  theta0, apply_fn = common.load_pretrained(workdir)
  os.makedirs(directory, exist_ok=True)
  common.use_compilation_cache(workdir)
  common.check_job_config(directory, {'finetune': config.finetune.to_dict(),
                                      'suite': common.suite_settings(config, 'train_size'),
                                      'logit_scale': config.head.logit_scale,
                                      'base': tree_lib.fingerprint(theta0)})
  if os.path.exists(out):
    logging.info('task vector found at %s', out)
    return checkpoint.load_task_vector(out)[0]
  task = common.load_task(config, task_name)
  head = common.head(config, workdir, task, theta0, apply_fn)
  loss_fn = head_lib.frozen_head_loss(regime.encoder(apply_fn), config.head.logit_scale)
  finetuned = train.train(config.finetune, loss_fn=loss_fn, params=theta0,
                          trainable=regime.trainable(theta0),
                          consts={'theta0': theta0, 'head': head}, data=task.train,
                          workdir=directory, mesh=common.mesh(config),
                          sharding_rules=config.sharding_rules)
  vector = TaskVector.from_params(theta0, finetuned, task=task_name, regime=regime.name)
  checkpoint.save_task_vector(out, vector)
  logging.info('saved the %s task vector of %s to %s', regime.name, task_name, out)
  return vector


if __name__ == '__main__':
  # Defined here, not at import, so that quickstart (which imports this module) has no --task.
  flags.DEFINE_enum('task', None, suite.DOWNSTREAM_TASKS, 'the task to fine-tune on')
  flags.mark_flag_as_required('task')
  app.run(common.app_main(lambda config, workdir: run(config, workdir, flags.FLAGS.task)))
