"""Fine-tuning θ0 on one task in one regime, and saving its task vector.

An image encoder trains through the task's frozen head, a decoder on its answers' tokens
(`editing.text_finetune`): the same loop, another loss. A task named in `config.poison.tasks`
is fine-tuned on its poisoned training set: the same loop, other data.
"""

import dataclasses
import os

import jax
import ml_collections
import numpy as np
from absl import logging

from editing import checkpoint
from editing import regimes
from editing import settings as settings_lib
from editing import text_finetune
from editing import train
from editing import tree as tree_lib
from editing.data import triggers
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import experiment
from editing.jobs import workdir as workdir_lib
from editing.models import head as head_lib
from editing.task_vector import TaskVector

# The settings of a training section that `editing.train.train` reads: config.finetune, and
# config.pretrain with its own (`pretrain.PRETRAIN`).
TRAINING = dict(
    steps=settings_lib.integer(100, '[1, inf)', 'optimizer steps'),
    batch_size=settings_lib.integer(128, '[1, inf)', 'examples per step, over every device'),
    learning_rate=settings_lib.number(1e-3, '(0, inf)', 'AdamW\'s peak learning rate'),
    weight_decay=settings_lib.number(0.1, '[0, inf)', 'AdamW\'s decoupled weight decay'),
    warmup_steps=settings_lib.integer(10, '[0, inf)', 'steps of linear warm-up before the '
                                                      'cosine decay'),
    grad_clip=settings_lib.number(1.0, '(0, inf)', 'the global gradient norm clipped to'),
    seed=settings_lib.integer(0, '[0, inf)', 'data order, and the initialisation of anything '
                                             'random'),
    checkpoint_every=settings_lib.integer(50, '[1, inf)', 'steps between checkpoints'),
    log_every=settings_lib.integer(10, '[1, inf)', 'steps between logged metrics'),
    accumulation=settings_lib.integer(1, '[1, inf)', 'microbatches per batch, their gradients '
                                                     'averaged'))
SECTIONS = {'finetune': TRAINING}


def run(config: ml_collections.ConfigDict, workdir: str, task_name: str,
        regime: regimes.Regime, directory: str | None = None) -> TaskVector:
  """Fine-tunes on `task_name` unless its task vector already exists; returns the vector.

  The run lives in `directory` (default <workdir>/finetune/<regime>/<task>); the pretrained
  backbone and heads are always the workdir's.
  """
  checks.validate(config, SECTIONS)
  directory = directory or workdir_lib.finetune_dir(workdir, regime.name, task_name)
  out = os.path.join(directory, workdir_lib.TASK_VECTOR)
  theta0, apply_fn = experiment.load_pretrained(workdir, config.model)
  os.makedirs(directory, exist_ok=True)
  workdir_lib.use_compilation_cache(workdir)
  poisoned = task_name in experiment.poisoned_tasks(config)
  settings = {'finetune': experiment.training_record(config.finetune),
              'regime': dataclasses.asdict(regime),
              **experiment.data_settings(config, 'train_size'),
              **experiment.head_settings(config),
              'base': tree_lib.fingerprint(theta0), **experiment.precision_settings(config)}
  if poisoned:
    settings['poison'] = {**config.poison.to_dict(), 'tasks': task_name,
                          config.poison.trigger: config[config.poison.trigger].to_dict()}
  workdir_lib.check_job_config(directory, settings)
  if os.path.exists(out):
    logging.info('task vector found at %s', out)
    return checkpoint.load_task_vector(out)[0]
  task = experiment.load_task(config, task_name)
  head = experiment.head(config, workdir, task, theta0, apply_fn)
  train_data = task.train
  if poisoned:
    train_data = triggers.poison(train_data, experiment.trigger(config, config.poison.trigger),
                                 rate=config.poison.rate, target=config.poison.target,
                                 seed=config.poison.seed)
    logging.info('poisoned %.0f%% of the %s training set with %s, target %d',
                 100 * config.poison.rate, task_name, config.poison.trigger,
                 config.poison.target)
  key = jax.random.PRNGKey(config.finetune.seed)
  if experiment.is_decoder(config):
    fit_mask = lambda: text_finetune.update_mask(regime, apply_fn, theta0, task.val, key)
    loss_fn = text_finetune.loss_fn(regime.training_encoder(apply_fn))
    consts = {'theta0': theta0}
  else:
    logits_fn = head_lib.logits_fn(regime.encoder(apply_fn), theta0, head,
                                   config.head.logit_scale)
    fit_mask = lambda: regime.update_mask(theta0, logits_fn=logits_fn,
                                          images=task.val.batch(np.arange(len(task.val)))[0],
                                          key=key)
    loss_fn = head_lib.frozen_head_loss(regime.training_encoder(apply_fn),
                                        config.head.logit_scale)
    consts = {'theta0': theta0, 'head': head_lib.padded(head)}
  update_mask = _update_mask(os.path.join(directory, workdir_lib.UPDATE_MASK), regime,
                             task.name, fit_mask)
  initial = regime.initial(theta0, key)
  finetuned = train.train(experiment.finetune_settings(config, task), loss_fn=loss_fn,
                          params=initial, trainable=regime.trainable(initial),
                          consts=consts, data=train_data,
                          workdir=directory, mesh=experiment.mesh(config),
                          sharding_rules=experiment.sharding_rules(config), update_mask=update_mask)
  vector = regime.task_vector(theta0, finetuned, task=task_name)
  extra = {}
  if update_mask is not None:
    extra['update_mask'] = workdir_lib.UPDATE_MASK
  if poisoned:
    extra['poison'] = settings['poison']
  checkpoint.save_task_vector(out, vector, extra)
  logging.info('saved the %s task vector of %s to %s', regime.name, task_name, out)
  return vector


def run_regimes(config: ml_collections.ConfigDict, workdir: str, task_name: str) -> None:
  """Fine-tunes `task_name`, one of the experiment's tasks, in every regime of
  `config.regimes`."""
  known = experiment.tasks(config)
  if task_name not in known:
    raise UserError(f'--task={task_name} is not a task of this experiment; choose one of '
                    f'{",".join(known)}')
  for regime in experiment.configured_regimes(config):
    run(config, workdir, task_name, regime)


def _update_mask(path, regime, task_name, fit):
  """The regime's update mask for this task, `fit()` on its (clean) val split once and kept
  at `path` beside the task vector; None for a dense regime."""
  if os.path.exists(path):
    return tree_lib.flatten(checkpoint.load_tree(path)[0])
  mask = fit()
  if mask is None:
    return None
  kept = sum(int(m.sum()) for m in mask.values())
  total = sum(m.size for m in mask.values())
  logging.info('%s keeps %d of %d eligible entries (%.1f%%) for %s', regime.name, kept, total,
               100 * kept / total, task_name)
  checkpoint.save_tree(path, tree_lib.unflatten(mask), {'regime': regime.name, 'task': task_name})
  return mask
