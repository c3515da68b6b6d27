"""Runs a short fine-tune through `editing.train.train` in its own process, for tests that kill
it, give it several simulated devices or run it as one of several processes.

  python tests/train_driver.py --workdir=W --out=params.npz [--steps=N] [--devices=K]
      [--fsdp=F --tensor=T --preset=fsdp+tp --placement=placement.json]
      [--ties_out=merged.npz] [--coordinator_address=H:P --num_processes=N --process_id=I]
"""

import argparse
import json

import jax
import numpy as np

from configs import quickstart
from editing import distributed
from editing import evaluate
from editing import regimes
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from editing import sharding
from editing.models import head as head_lib
from editing.models import vit
from editing.task_vector import TaskVector
from merging import ties


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
  parser.add_argument('--ties_out', default='',
                      help='where to write a TIES merge, on the mesh, of three fixed random '
                           'vectors, and the test predictions of θ0 plus a little of it')
  parser.add_argument('--coordinator_address', default=None)
  parser.add_argument('--num_processes', type=int, default=None)
  parser.add_argument('--process_id', type=int, default=None)
  args = parser.parse_args()
  if args.num_processes:
    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)

  config = quickstart.get_config('tiny')
  task = suite.load_task('colour', seed=0, train_size=256, test_size=40)
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
  if distributed.is_primary():
    np.savez(args.out, **{k: np.asarray(v) for k, v in tree_lib.flatten(params).items()})
  if args.ties_out:
    # Inputs that do not depend on the training's float noise, so results compare bit for bit.
    rng = np.random.default_rng(3)
    vectors = [TaskVector(jax.tree.map(lambda x: rng.standard_normal(np.shape(x), np.float32),
                                       theta0), (name,), args.regime, 'random')
               for name in ('a', 'b', 'c')]
    placed = [v.replace(delta=jax.device_put(v.delta, sharding.param_shardings(mesh, v.delta,
                                                                              rules)))
              for v in vectors]
    # One jitted program: on CPU processes (gloo), the same merge dispatched eagerly, op by op,
    # deadlocked after an orbax save (jax 0.10.2).
    merged = jax.jit(lambda vs: ties.merge(vs, density=0.2, scope='global'))(placed)
    evaluator = evaluate.Evaluator(encoder, mesh=mesh, batch_size=16, sharding_rules=rules)
    predictions = evaluator.predictions(theta0, evaluator.edit(theta0, merged, 0.01), head,
                                        task.test)
    merged = tree_lib.flatten(distributed.to_host(merged.delta))
    if distributed.is_primary():
      np.savez(args.ties_out, **merged, predictions=predictions)

if __name__ == '__main__':
  main()
