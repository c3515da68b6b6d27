r"""Fine-tunes θ0 on one task of the suite, in each configured regime, and saves its task vectors.

  python -m launch.finetune --workdir=workdir/quickstart --task=digits \
      [--config.regimes=full,talos] [--config.finetune.steps=200]
"""

import dataclasses
import os

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging

from editing import checkpoint
from editing import regimes
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from editing.models import head as head_lib
from editing.task_vector import TaskVector
from launch import common


def run(config: ml_collections.ConfigDict, workdir: str, task_name: str,
        regime: regimes.Regime) -> TaskVector:
  """Fine-tunes on `task_name` unless its task vector already exists; returns the vector."""
  out = common.task_vector_file(workdir, regime.name, task_name)
  directory = common.finetune_dir(workdir, regime.name, task_name)
  theta0, apply_fn = common.load_pretrained(workdir)
  os.makedirs(directory, exist_ok=True)
  common.use_compilation_cache(workdir)
  common.check_job_config(directory, {'finetune': config.finetune.to_dict(),
                                      'regime': dataclasses.asdict(regime),
                                      'suite': common.suite_settings(config, 'train_size'),
                                      'logit_scale': config.head.logit_scale,
                                      'base': tree_lib.fingerprint(theta0)})
  if os.path.exists(out):
    logging.info('task vector found at %s', out)
    return checkpoint.load_task_vector(out)[0]
  task = common.load_task(config, task_name)
  head = common.head(config, workdir, task, theta0, apply_fn)
  encoder = regime.encoder(apply_fn)
  update_mask = _update_mask(config, workdir, regime, task, theta0, encoder, head)
  loss_fn = head_lib.frozen_head_loss(encoder, config.head.logit_scale)
  finetuned = train.train(config.finetune, loss_fn=loss_fn, params=theta0,
                          trainable=regime.trainable(theta0),
                          consts={'theta0': theta0, 'head': head}, data=task.train,
                          workdir=directory, mesh=common.mesh(config),
                          sharding_rules=config.sharding_rules, update_mask=update_mask)
  vector = TaskVector.from_params(theta0, finetuned, task=task_name, regime=regime.name)
  extra = {'update_mask': os.path.basename(common.update_mask_file(
      workdir, regime.name, task_name))} if update_mask is not None else None
  checkpoint.save_task_vector(out, vector, extra)
  logging.info('saved the %s task vector of %s to %s', regime.name, task_name, out)
  return vector


def _update_mask(config, workdir, regime, task, theta0, encoder, head):
  """The regime's update mask for this task, fitted on its val split once and kept beside the
  task vector; None for a dense regime."""
  path = common.update_mask_file(workdir, regime.name, task.name)
  if os.path.exists(path):
    return tree_lib.flatten(checkpoint.load_tree(path)[0])
  logits_fn = lambda params, images: head_lib.logits(encoder(theta0, params, images), head,
                                                     config.head.logit_scale)
  images, _ = task.val.batch(np.arange(len(task.val)))
  mask = regime.update_mask(theta0, logits_fn=logits_fn, images=images,
                            key=jax.random.PRNGKey(config.finetune.seed))
  if mask is None:
    return None
  kept = sum(int(m.sum()) for m in mask.values())
  total = sum(m.size for m in mask.values())
  logging.info('%s keeps %d of %d eligible entries (%.1f%%) for %s', regime.name, kept, total,
               100 * kept / total, task.name)
  checkpoint.save_tree(path, tree_lib.unflatten(mask), {'regime': regime.name, 'task': task.name})
  return mask


if __name__ == '__main__':
  # Defined here, not at import, so that quickstart (which imports this module) has no --task.
  flags.DEFINE_enum('task', None, suite.DOWNSTREAM_TASKS, 'the task to fine-tune on')
  flags.mark_flag_as_required('task')

  def _finetune_every_regime(config, workdir):
    for regime in common.configured_regimes(config):
      run(config, workdir, flags.FLAGS.task, regime)

  app.run(common.app_main(_finetune_every_regime))
