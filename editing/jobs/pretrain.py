"""Pretraining the suite's backbone θ0, with a cosine head learned jointly and then discarded.

`config.pretrain.corpus` chooses what θ0 learns from:
- 'captions': every word of a captioned scene (`editing.data.captions`): broad attributes at a
  coarser grain than the downstream tasks, a multi-label sigmoid per word;
- 'shapes': the control task alone, an 8-way softmax.
"""

import os

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from editing import checkpoint
from editing import train
from editing import tree as tree_lib
from editing.data import captions
from editing.data import suite
from editing.errors import UserError
from editing.jobs import experiment
from editing.jobs import workdir as workdir_lib
from editing.models import head as head_lib

CORPORA = ('captions', 'shapes')


def run(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Trains encoder + head unless done; writes <workdir>/pretrain/params.safetensors."""
  experiment.validate(config)
  if config.pretrain.corpus not in CORPORA:
    raise UserError(f'config.pretrain.corpus = {config.pretrain.corpus!r}: must be one of '
                    f'{CORPORA}')
  out = workdir_lib.pretrained_file(workdir)
  directory = workdir_lib.pretrain_dir(workdir)
  sections = {'model': config.model.to_dict(), 'pretrain': config.pretrain.to_dict()}
  if config.pretrain.corpus == 'shapes':
    # The captions corpus is drawn from the pretraining seed alone: one backbone serves
    # every suite seed.
    sections['suite'] = experiment.suite_settings(config, 'pretrain_size')
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
  module, apply_fn = experiment.model(config.model)
  scale = config.pretrain.logit_scale
  if config.pretrain.corpus == 'captions':
    data = captions.load_corpus(config.pretrain.seed, config.pretrain.corpus_size)
    num_outputs = len(captions.VOCABULARY)
    # A per-word bias: most words are absent from most captions.
    loss_fn = head_lib.multilabel_loss(lambda params, consts, images: head_lib.logits(
        apply_fn(params['encoder'], images), params['head'], scale) + params['bias'])
  else:
    task = experiment.load_task(config, suite.CONTROL_TASK)
    data, num_outputs = task.train, task.num_classes
    loss_fn = head_lib.cross_entropy_loss(lambda params, consts, images: head_lib.logits(
        apply_fn(params['encoder'], images), params['head'], scale))
  key_encoder, key_head = jax.random.split(jax.random.PRNGKey(config.seed))
  params = {'encoder': module.init(key_encoder, data.batch([0])[0])['params'],
            'head': jax.random.normal(key_head, (num_outputs, config.model.embed_dim))}
  if config.pretrain.corpus == 'captions':
    params['bias'] = jnp.zeros((num_outputs,))
  trainable = {path: True for path in tree_lib.flatten(params)}
  trained = train.train(config.pretrain, loss_fn=loss_fn, params=params, trainable=trainable,
                        consts={}, data=data, workdir=directory,
                        mesh=experiment.mesh(config), sharding_rules=config.sharding_rules)
  checkpoint.save_tree(out, trained['encoder'], {'model': config.model.to_dict()})
  logging.info('saved the pretrained backbone to %s', out)
