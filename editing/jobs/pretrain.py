"""Pretraining the suite's backbone θ0 on the control task (shapes), with a cosine head learned
jointly and then discarded."""

import os

import jax
import ml_collections
from absl import logging

from editing import checkpoint
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from editing.errors import UserError
from editing.jobs import experiment
from editing.jobs import workdir as workdir_lib
from editing.models import head as head_lib


def run(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Trains encoder + head on shapes unless done; writes <workdir>/pretrain/params.safetensors."""
  experiment.validate(config)
  out = workdir_lib.pretrained_file(workdir)
  directory = workdir_lib.pretrain_dir(workdir)
  sections = {'model': config.model.to_dict(),
              'suite': experiment.suite_settings(config, 'pretrain_size'),
              'pretrain': config.pretrain.to_dict()}
  os.makedirs(directory, exist_ok=True)
  workdir_lib.use_compilation_cache(workdir)
  workdir_lib.check_job_config(directory, sections)
  if os.path.exists(out):
    recorded = checkpoint.load_tree(out)[1].get('model')
    if recorded != config.model.to_dict():
      raise UserError(f'{out} holds a backbone of model {recorded}, not config.model '
                      f'{config.model.to_dict()}; use another --workdir')
    logging.info('pretrained backbone found at %s', out)
    return
  task = experiment.load_task(config, suite.CONTROL_TASK)
  module, apply_fn = experiment.model(config.model)
  key_encoder, key_head = jax.random.split(jax.random.PRNGKey(config.seed))
  encoder = module.init(key_encoder, task.train.batch([0])[0])['params']
  params = {'encoder': encoder,
            'head': jax.random.normal(key_head, (task.num_classes, config.model.embed_dim))}
  loss_fn = head_lib.cross_entropy_loss(lambda params, consts, images: head_lib.logits(
      apply_fn(params['encoder'], images), params['head'], config.pretrain.logit_scale))
  trainable = {path: True for path in tree_lib.flatten(params)}
  trained = train.train(config.pretrain, loss_fn=loss_fn, params=params, trainable=trainable,
                        consts={}, data=task.train, workdir=directory,
                        mesh=experiment.mesh(config), sharding_rules=config.sharding_rules)
  checkpoint.save_tree(out, trained['encoder'], {'model': config.model.to_dict()})
  logging.info('saved the pretrained backbone to %s', out)
