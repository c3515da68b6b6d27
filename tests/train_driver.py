"""Runs a short fine-tune through `editing.train.train` in its own process, for tests that kill
it or give it several simulated devices.

  python tests/train_driver.py --workdir=W --out=params.npz [--steps=N] [--devices=K]
      [--fsdp=F --tensor=T --preset=fsdp+tp --placement=placement.json]
"""

import argparse
import json

import jax
import numpy as np

from configs import quickstart
from editing import regimes
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from editing import sharding
from editing.models import head as head_lib
from editing.models import vit


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--out', required=True)
  parser.add_argument('--steps', type=int, default=40)
  parser.add_argument('--devices', type=int, default=1)
  parser.add_argument('--checkpoint_every', type=int, default=2)
  parser.add_argument('--regime', default='full')
  parser.add_argument('--fsdp', type=int, default=1)
  parser.add_argument('--tensor', type=int, default=1)
  parser.add_argument('--preset', default='dp')
  parser.add_argument('--placement', default='',
                      help='where to write, per trained leaf and constant, its bytes, the bytes '
                           'of each of its device shards and the mesh axes it is split over')
  args = parser.parse_args()

  config = quickstart.get_config('tiny')
  task = suite.load_task('colour', seed=0, train_size=256, test_size=8)
  module = vit.build(config.model)
  theta0 = module.init(jax.random.PRNGKey(0), task.train.batch([0])[0])['params']
  head = jax.random.normal(jax.random.PRNGKey(1), (task.num_classes, config.model.embed_dim))
  regime = regimes.get(args.regime)
  encoder = regime.encoder(lambda p, x: module.apply({'params': p}, x))
  loss_fn = head_lib.frozen_head_loss(encoder, config.head.logit_scale)
  update_mask = regime.update_mask(
      theta0, images=task.val.batch(np.arange(len(task.val)))[0], key=jax.random.PRNGKey(2),
      logits_fn=head_lib.logits_fn(encoder, theta0, head, config.head.logit_scale))

  train_config = quickstart.training(steps=args.steps, batch_size=32, learning_rate=1e-3,
                                     warmup_steps=3, checkpoint_every=args.checkpoint_every,
                                     log_every=1)
  mesh = sharding.make_mesh(args.devices, args.fsdp, args.tensor)
  rules = sharding.logical_rules(args.preset)
  if args.placement:
    prepared = train.prepare(train_config, loss_fn=loss_fn, params=theta0,
                             trainable=regime.trainable(theta0),
                             consts={'theta0': theta0, 'head': head}, mesh=mesh,
                             sharding_rules=rules, update_mask=update_mask)
    leaves = {**prepared.state.params,
              **{f'consts/{p}': x
                 for p, x in tree_lib.flatten(prepared.inputs.consts).items()}}
    placement = {path: {'bytes': int(leaf.nbytes),
                        'shard_bytes': sorted({int(s.data.nbytes)
                                               for s in leaf.addressable_shards}),
                        'axes': [a for a in leaf.sharding.spec if a is not None]}
                 for path, leaf in leaves.items()}
    with open(args.placement, 'w') as f:
      json.dump(placement, f)
  params = train.train(train_config, loss_fn=loss_fn, params=theta0,
                       trainable=regime.trainable(theta0),
                       consts={'theta0': theta0, 'head': head}, data=task.train,
                       workdir=args.workdir, mesh=mesh, sharding_rules=rules,
                       update_mask=update_mask)
  np.savez(args.out, **{k: np.asarray(v) for k, v in tree_lib.flatten(params).items()})


if __name__ == '__main__':
  main()
