r"""Pretrains the suite's backbone on the control task (shapes) and saves θ0.

  python -m launch.pretrain --workdir=workdir/quickstart [--config=configs/quickstart.py[:tiny]]
"""

import os

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import app, logging

from editing import checkpoint
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from editing.models import head as head_lib
from launch import common


def run(config: ml_collections.ConfigDict, workdir: str):
  """Trains encoder + a cosine head on shapes; writes <workdir>/pretrain/params.safetensors."""
  out = common.pretrained_file(workdir)
  directory = common.pretrain_dir(workdir)
  sections = {'model': config.model.to_dict(),
              'suite': common.suite_settings(config, 'pretrain_size'),
              'pretrain': config.pretrain.to_dict()}
  os.makedirs(directory, exist_ok=True)
  common.use_compilation_cache(workdir)
  common.check_job_config(directory, sections)
  if os.path.exists(out):
    logging.info('pretrained backbone found at %s', out)
    return
  task = common.load_task(config, suite.CONTROL_TASK)
  module, apply_fn = common.model(config.model)
  key_encoder, key_head = jax.random.split(jax.random.PRNGKey(config.seed))
  encoder = module.init(key_encoder, task.train.batch([0])[0])['params']
  params = {'encoder': encoder,
            'head': jax.random.normal(key_head, (task.num_classes, config.model.embed_dim))}

  def loss_fn(params, consts, images, labels, rng):
    del consts, rng
    logits = head_lib.logits(apply_fn(params['encoder'], images), params['head'],
                             config.pretrain.logit_scale)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {'accuracy': jnp.mean(jnp.argmax(logits, -1) == labels)}

  trainable = {path: True for path in tree_lib.flatten(params)}
  trained = train.train(config.pretrain, loss_fn=loss_fn, params=params, trainable=trainable,
                        consts={}, data=task.train, workdir=directory, mesh=common.mesh(config),
                        sharding_rules=config.sharding_rules)
  checkpoint.save_tree(out, trained['encoder'], {'model': config.model.to_dict()})
  logging.info('saved the pretrained backbone to %s', out)


if __name__ == '__main__':
  app.run(common.app_main(run))
