r"""Measures fine-tuning step throughput (images/s) of the configured model, in one process.

  python -m launch.benchmark [--config=configs/quickstart.py] [--benchmark_steps=20]

Times the same jitted step the training loop runs (`editing.train.prepare`), after one compile
step, on a batch of the suite's images; prints and writes <workdir>/benchmark.json.
"""

import os
import time

import jax
import numpy as np
from absl import app, flags

from editing import checkpoint
from editing import regimes
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from editing.models import head as head_lib
from launch import common

_STEPS = flags.DEFINE_integer('benchmark_steps', 20, 'timed steps after the compile step')


def run(config, workdir: str, steps: int) -> dict:
  module, apply_fn = common.model(config.model)
  task = suite.load_task('colour', seed=0, train_size=config.finetune.batch_size * 2,
                         test_size=8)
  images, labels = task.train.batch(np.arange(config.finetune.batch_size))
  theta0 = module.init(jax.random.PRNGKey(0), images[:1])['params']
  head = jax.random.normal(jax.random.PRNGKey(1), (task.num_classes, config.model.embed_dim))
  regime = regimes.get(config.finetune.regime)
  loss_fn = head_lib.frozen_head_loss(regime.encoder(apply_fn), config.head.logit_scale)
  prepared = train.prepare(config.finetune, loss_fn=loss_fn, params=theta0,
                           trainable=regime.trainable(theta0),
                           consts={'theta0': theta0, 'head': head}, mesh=common.mesh(config),
                           sharding_rules=config.sharding_rules)
  images, labels = jax.device_put((images, labels), prepared.batch_sharding)
  state = prepared.state
  timings = []
  for _ in range(steps + 1):
    start = time.perf_counter()
    state, metrics = prepared.step(state, prepared.frozen, prepared.consts, images, labels)
    jax.block_until_ready(metrics['loss'])
    timings.append(time.perf_counter() - start)
  step_seconds = float(np.median(timings[1:]))
  result = {'regime': regime.name, 'params': tree_lib.num_params(theta0),
            'batch_size': config.finetune.batch_size, 'devices': jax.device_count(),
            'compile_and_first_step_s': timings[0], 'median_step_s': step_seconds,
            'images_per_s': config.finetune.batch_size / step_seconds}
  print('  '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}'
                  for k, v in result.items()))
  checkpoint.atomic_write_json(os.path.join(workdir, 'benchmark.json'), result)
  return result


if __name__ == '__main__':
  app.run(common.app_main(lambda config, workdir: run(config, workdir, _STEPS.value)))
