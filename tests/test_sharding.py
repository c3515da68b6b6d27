"""Fine-tuning on (data, fsdp, tensor) meshes of 8 simulated CPU devices equals one device, and
the logical-axis presets really divide the parameters' memory across the devices."""

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from editing import sharding
from editing.errors import UserError
from tests.conftest import REPO, run_python, xla_flags
from tests.test_train import DRIVER, assert_bitwise_equal, load

# (fsdp, tensor, preset, regime) on 8 devices; data takes the rest.
# Data parallel, tensor parallel alone, and all three axes at once (fsdp alone splits the
# merges of every method in `test_every_merge_method_on_a_2x4x1_mesh_equals_one_device`).
MESHES = [(1, 1, 'dp', 'full'), (1, 8, 'fsdp+tp', 'full'), (2, 2, 'fsdp+tp', 'linearized')]


@pytest.fixture(scope='module')
def one_device(tmp_path_factory):
  root = tmp_path_factory.mktemp('one_device')
  out = {}
  for regime in sorted({m[3] for m in MESHES}):
    run_python([DRIVER, f'--workdir={root / regime}', f'--out={root / regime}.npz', '--steps=3',
                '--devices=1', f'--regime={regime}', f'--ties_out={root / regime}_ties.npz'])
    out[regime] = (load(root / f'{regime}.npz'), _metrics(root / regime),
                   load(root / f'{regime}_ties.npz'))
  return out


def _metrics(workdir):
  with open(workdir / 'metrics.jsonl') as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize('fsdp, tensor, preset, regime', MESHES,
                         ids=[f'{8 // (f * t)}x{f}x{t}-{p}-{r}' for f, t, p, r in MESHES])
def test_fine_tuning_on_a_mesh_equals_one_device(tmp_path, one_device, fsdp, tensor, preset,
                                                 regime):
  run_python([DRIVER, f'--workdir={tmp_path / "run"}', f'--out={tmp_path}/params.npz',
              '--steps=3', '--devices=8', f'--fsdp={fsdp}', f'--tensor={tensor}',
              f'--preset={preset}', f'--regime={regime}',
              f'--placement={tmp_path}/placement.json'],
             env={'XLA_FLAGS': xla_flags(devices=8)})
  params, metrics, _ = one_device[regime]
  # The loss and the gradient norm see the whole global batch: they agree to float precision.
  # Adam divides by sqrt(v): for near-zero gradients, summation-order noise grows to a fraction
  # of the learning rate (1e-3), so params get an absolute tolerance well below one step.
  for m1, m8 in zip(metrics, _metrics(tmp_path / 'run'), strict=True):
    np.testing.assert_allclose(m8['loss'], m1['loss'], rtol=1e-5)
    np.testing.assert_allclose(m8['grad_norm'], m1['grad_norm'], rtol=1e-5)
  sharded = load(tmp_path / 'params.npz')
  for k in params:
    np.testing.assert_allclose(sharded[k], params[k], rtol=0, atol=2e-4, err_msg=k)

  with open(tmp_path / 'placement.json') as f:
    placement = json.load(f)
  sizes = {'data': 8 // (fsdp * tensor), 'fsdp': fsdp, 'tensor': tensor}
  for path, leaf in placement.items():
    split = int(np.prod([sizes[a] for a in leaf['axes']]))
    assert leaf['shard_bytes'] == [leaf['bytes'] // split], path
  # The MLP's first matrix (embed 32 × mlp 64), trained and as θ0 among the constants, splits
  # over fsdp by its embed dimension and over tensor by its mlp one, as the preset says; the
  # head is replicated.
  split = {'dp': 1, 'fsdp': fsdp, 'fsdp+tp': fsdp * tensor}[preset]
  for path in ('blocks_0/mlp_fc/kernel', 'consts/theta0/blocks_0/mlp_fc/kernel'):
    mlp = placement[path]
    assert mlp['shard_bytes'] == [mlp['bytes'] // split]
  assert placement['consts/head']['axes'] == []
  total = sum(leaf['bytes'] for leaf in placement.values())
  per_device = sum(leaf['shard_bytes'][0] for leaf in placement.values())
  assert (per_device == total) == (split == 1), (per_device, total)


def test_a_mesh_that_does_not_divide_the_devices_is_refused():
  with pytest.raises(UserError, match='fsdp=3 × tensor=1 does not divide'):
    sharding.make_mesh(None, fsdp=3)
  with pytest.raises(UserError, match="preset 'zero'"):
    sharding.logical_rules('zero')


EVALUATION = r'''
import json, sys
import jax, numpy as np
from configs import quickstart
from editing import evaluate, sharding, tree as tree_lib
from editing.data import suite
from editing.models import vit
from editing.regimes import get as regime
from editing.task_vector import TaskVector

config = quickstart.get_config('tiny')
task = suite.load_task('colour', seed=0, train_size=64, test_size=40)
module = vit.build(config.model)
apply_fn = lambda p, x: module.apply({'params': p}, x)
theta0 = module.init(jax.random.PRNGKey(0), task.test.batch([0])[0])['params']
vector = TaskVector(jax.tree.map(lambda x: 0.05 * jax.random.normal(jax.random.PRNGKey(1),
                                                                    x.shape), theta0),
                    ('colour',), 'full', 'b')
head = jax.random.normal(jax.random.PRNGKey(2), (task.num_classes, config.model.embed_dim))
out = {}
for name, mesh, rules in [('one', sharding.make_mesh(1), sharding.logical_rules('dp')),
                          ('fsdp', sharding.make_mesh(8, fsdp=4), sharding.logical_rules('fsdp'))]:
  evaluator = evaluate.Evaluator(regime('full').encoder(apply_fn), mesh=mesh,
                                 batch_size=16, sharding_rules=rules)
  params = evaluator.edit(theta0, vector, 0.7)
  out[name] = {'features': evaluator.features(theta0, params, task.test).tolist(),
               'predictions': evaluator.predictions(theta0, params, head, task.test).tolist(),
               'split': [a for a in params['blocks_0']['mlp_fc']['kernel'].sharding.spec
                         if a is not None]}
json.dump(out, sys.stdout)
'''


def test_evaluation_on_an_fsdp_mesh_equals_one_device():
  proc = run_python(['-c', EVALUATION],
                    env={'XLA_FLAGS': xla_flags(devices=8)})
  out = json.loads(proc.stdout)
  # θ0 + α·τ stays split as the rules place the params.
  assert out['fsdp']['split'] == ['fsdp'] and out['one']['split'] == []
  np.testing.assert_allclose(out['fsdp']['features'], out['one']['features'], rtol=0, atol=1e-5)
  assert out['fsdp']['predictions'] == out['one']['predictions']


SHARDED_INIT = r'''
import json, sys
import jax, jax.numpy as jnp, ml_collections, numpy as np
from editing import sharding, tree as tree_lib
from editing.models import vit

# ViT-B/16's image tower: 86M parameters.
model = vit.build(ml_collections.ConfigDict(dict(
    patch_size=16, width=768, depth=12, num_heads=12, mlp_dim=3072, embed_dim=512)))
mesh = sharding.make_mesh(8, fsdp=8)
rules = sharding.logical_rules('fsdp')
args = (jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32))
shapes = jax.eval_shape(model.init, *args)
compiled = sharding.sharded_initializer(model.init, mesh, rules, *args).lower(*args).compile()
per_device = [0] * 8
leaves = []
for shape, out in zip(jax.tree.leaves(shapes), jax.tree.leaves(compiled.output_shardings)):
  nbytes = int(np.prod(shape.shape)) * shape.dtype.itemsize
  leaves.append(nbytes)
  for device, index in out.devices_indices_map(shape.shape).items():
    size = int(np.prod([len(range(*i.indices(n))) for i, n in zip(index, shape.shape)]))
    per_device[device.id] += size * shape.dtype.itemsize
json.dump({'total': sum(leaves), 'largest': max(leaves), 'per_device': per_device,
           'params': sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))}, sys.stdout)
'''


def test_a_vit_b16_initialises_split_over_eight_devices():
  proc = run_python(['-c', SHARDED_INIT],
                    env={'XLA_FLAGS': xla_flags(devices=8)})
  out = json.loads(proc.stdout)
  assert 85e6 < out['params'] < 88e6
  # Read from the compiled initialiser's output shardings, without running it.
  assert max(out['per_device']) <= out['total'] / 8 + out['largest'], out
  # Only norms and biases stay whole: each device holds within 2% of an eighth.
  assert max(out['per_device']) < 1.02 * out['total'] / 8, out


def test_merges_on_an_fsdp_mesh_equal_one_device(tiny_run, tmp_path):
  """The merge job (TIES' global top-k, a closed form) on 8 devices as 2×4×1 with the fsdp
  preset, against one device: the same λ and settings chosen, the same accuracies. Every
  method's merge alone is `test_every_merge_method_on_a_2x4x1_mesh_equals_one_device`'s."""
  _, source, _ = tiny_run
  methods = 'ties,regmean'
  results = {}
  for name, flags in (('one', ['--config.num_devices=1']),
                      ('fsdp', ['--config.num_devices=8', '--config.sharding.preset=fsdp',
                                '--config.sharding.fsdp=4'])):
    workdir = tmp_path / name
    shutil.copytree(source, workdir)
    run_python(['-m', 'launch.merge', '--config=configs/merge.py:tiny', f'--workdir={workdir}',
                '--config.regimes=full', f'--config.merge.methods={methods}', *flags],
               env={'XLA_FLAGS': xla_flags(devices=8)})
    with open(workdir / 'merge' / 'full' / 'results.json') as f:
      results[name] = json.load(f)['methods']
  assert set(results['one']) == set(results['fsdp']) == set(methods.split(','))
  for method, one in results['one'].items():
    fsdp = results['fsdp'][method]
    assert fsdp['lambda'] == one['lambda'] and fsdp['hyperparameters'] == one['hyperparameters']
    for task, accuracy in one['test'].items():
      # Summation order differs across devices; an example whose two best logits are that
      # close may flip, so one test example (1/128) is allowed.
      assert abs(fsdp['test'][task] - accuracy) <= 1 / 128 + 1e-9, (method, task)


def test_two_processes_fine_tune_merge_and_evaluate_as_one_device(tmp_path, one_device):
  """`jax.distributed` on localhost: two processes of 4 CPU devices each, one (1, 8, 1) mesh
  across both (every leaf split over the processes, each reading half of every batch), against
  one device."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices=4),
             PYTHONPATH=REPO)
  processes = [subprocess.Popen(
      [sys.executable, DRIVER, '--steps=3', '--devices=8', '--fsdp=8', '--preset=fsdp',
       f'--workdir={tmp_path / "run"}', f'--out={tmp_path}/params.npz',
       f'--ties_out={tmp_path}/ties.npz', f'--coordinator_address=localhost:{port}',
       '--num_processes=2', f'--process_id={i}'],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  for i, process in enumerate(processes):
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, f'process {i}:\n{output[-3000:]}'

  params, metrics, ties = one_device['full']
  # The tolerances of the single-process mesh tests above.
  for m1, m2 in zip(metrics, _metrics(tmp_path / 'run'), strict=True):
    np.testing.assert_allclose(m2['loss'], m1['loss'], rtol=1e-5)
  two = load(tmp_path / 'params.npz')
  assert two.keys() == params.keys()
  for k in params:
    np.testing.assert_allclose(two[k], params[k], rtol=0, atol=2e-4, err_msg=k)
  # TIES of fixed inputs, its global top-k gathered across the processes, is exact; so are
  # the evaluator's predictions of θ0 plus a little of it.
  assert_bitwise_equal(load(tmp_path / 'ties.npz'), ties)


EVERY_MERGE = r'''
import json, sys
import jax, numpy as np
import merging
from editing import sharding, tree as tree_lib
from tests.test_merging import random_vectors, run

mesh = sharding.make_mesh(8, fsdp=4)
# The toy net's first kernel (4 × 6) splits over fsdp by its rows; the rest stays whole.
rules = [(r'hidden/kernel', ('fsdp', None)), (r'.*', ())]
vectors = random_vectors()
placed = [v.replace(delta=jax.device_put(v.delta, sharding.param_shardings(mesh, v.delta, rules)))
          for v in vectors]
assert not placed[0].delta['hidden']['kernel'].sharding.is_fully_replicated
out = {}
# DAM's variants differ from it only in which masks they learn; WEMoE's merge is a routed
# model of an image encoder's MLPs, which the toy problem has not.
for name in [n for n, m in merging.REGISTRY.items()
             if not m.low_rank and not m.forward
             and n not in ('dam_shared', 'dam_safe', 'dam_oracle')]:
  merged = [run(name, vs) for vs in (vectors, placed)]
  # A per-task method's vectors, one per task, compared task by task.
  pairs = (zip(*merged) if merging.get(name).per_task else [merged])
  out[name] = max(float(np.abs(np.asarray(b) - np.asarray(a)).max())
                  for one, split in pairs
                  for a, b in zip(tree_lib.flatten(one.delta).values(),
                                  tree_lib.flatten(split.delta).values()))
json.dump(out, sys.stdout)
'''


def test_every_merge_method_on_a_2x4x1_mesh_equals_one_device():
  """Each dense method of `merging.REGISTRY` (DAM's mask variants by DAM) on task vectors split
  over a 2×4×1 mesh, against the same vectors on one device (tests/test_merging.py's toy
  problem and fast settings)."""
  proc = run_python(['-c', EVERY_MERGE],
                    env={'XLA_FLAGS': xla_flags(devices=8)})
  differences = json.loads(proc.stdout)
  data_free = ('averaging', 'task_arithmetic', 'ties', 'dare', 'breadcrumbs', 'consensus')
  for name, difference in differences.items():
    # The data-free merges are elementwise or rank exactly: the same bits. The data-driven
    # ones sum over examples and devices in another order: float rounding, then (AdaMerging,
    # DAM) a few optimizer steps of it.
    assert difference <= (0 if name in data_free else 1e-5), (name, difference)
