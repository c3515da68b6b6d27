"""The decoder on (data, fsdp, tensor) meshes of 8 simulated CPU devices: the same logits and
the same AdamW step as one device, and checkpoints loaded leaf by leaf onto the mesh."""

import json

import numpy as np
import pytest

from editing import tree as tree_lib
from editing.models.decoder_config import DecoderConfig
from tests.conftest import run_python, xla_flags
from third_party import hf_decoder

# A tiny random Llama, and a Gemma-2-like one: tied head, (1 + w) norms, sliding window,
# soft-capping. Every split dimension divides its mesh axes: embed 32 by fsdp 4, vocab 128,
# heads 4, kv_heads 2 and mlp 48 by tensor 2.
SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
CONFIGS = {
    'llama': dict(model_type='llama', **SIZES),
    'gemma2': dict(model_type='gemma2', sliding_window=5, query_pre_attn_scalar=16,
                   attn_logit_softcapping=1.0, final_logit_softcapping=3.0, **SIZES),
}
# name: (fsdp, tensor, preset) on 8 devices, data taking the rest; 'one' is a 1-device mesh.
MESHES = {'one': (1, 1, 'dp'), '8x1x1': (1, 1, 'dp'), '2x4x1': (4, 1, 'fsdp'),
          '2x2x2': (2, 2, 'fsdp+tp')}
# (family, mesh): the Llama on every mesh, the Gemma on the one that uses every axis.
RUNS = [('llama', m) for m in MESHES] + [('gemma2', 'one'), ('gemma2', '2x2x2')]

STEP = r'''
import json, sys
import jax, numpy as np, optax
from editing import sharding, tree as tree_lib
from editing.models import decoder
from editing.models.decoder_config import DecoderConfig

configs, meshes, runs = (json.loads(a) for a in sys.argv[1:4])
out = sys.argv[4]
tokens = np.random.default_rng(0).integers(0, 128, (8, 16)).astype(np.int32)
positions = np.broadcast_to(np.arange(16, dtype=np.int32), tokens.shape)
mask = np.ones(tokens.shape, bool)
optimizer = optax.adamw(1e-3, weight_decay=0.1)
placement = {}
for family, name in runs:
  model = decoder.Decoder(DecoderConfig.from_hf(configs[family]))
  # Every leaf random, norms included, so that no split can hide behind ones or zeros.
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens, positions, mask)
  rng = np.random.default_rng(1)
  theta = jax.tree.map(lambda x: rng.normal(0, 0.3, x.shape).astype(np.float32),
                       shapes['params'])

  def step(params, tokens):
    def loss_fn(params):
      logits = model.apply({'params': params}, tokens, positions, mask)[0]
      nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
      return nll.mean(), logits
    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return logits, loss, optax.apply_updates(params, updates)

  fsdp, tensor, preset = meshes[name]
  mesh = sharding.make_mesh(1 if name == 'one' else 8, fsdp=fsdp, tensor=tensor)
  shardings = sharding.param_shardings(mesh, theta, sharding.logical_rules(preset))
  params = jax.device_put(theta, shardings)
  batch = jax.device_put(tokens, sharding.batch_sharding(mesh))
  logits, loss, new = jax.jit(step, out_shardings=(None, None, shardings))(params, batch)
  np.savez(f'{out}/{family}-{name}.npz', logits=logits, loss=loss,
           **{'params/' + p: x for p, x in tree_lib.flatten(new).items()})
  placement[f'{family}-{name}'] = {p: [a for a in x.sharding.spec if a is not None]
                                   for p, x in tree_lib.flatten(new).items()}
json.dump(placement, sys.stdout)
'''


@pytest.fixture(scope='module', name='stepped')
def stepped_fixture(tmp_path_factory):
  """({'family-mesh': npz of logits, loss, updated params}, {'family-mesh': {path: axes}}),
  from one process of 8 devices running every mesh."""
  out = tmp_path_factory.mktemp('steps')
  proc = run_python(['-c', STEP, json.dumps(CONFIGS), json.dumps(MESHES), json.dumps(RUNS),
                     str(out)], env={'XLA_FLAGS': xla_flags(devices=8)})
  runs = {f.stem: dict(np.load(f)) for f in out.glob('*.npz')}
  return runs, json.loads(proc.stdout)


@pytest.mark.parametrize('family, mesh', [r for r in RUNS if r[1] != 'one'],
                         ids=[f'{f}-{m}' for f, m in RUNS if m != 'one'])
def test_a_step_on_a_mesh_equals_one_device(stepped, family, mesh):
  runs, placement = stepped
  one, split = runs[f'{family}-one'], runs[f'{family}-{mesh}']
  # float32 sums in another order over the devices. Logits of magnitude up to ~4 (ulp 2.4e-7)
  # agree to a few ulps (measured: ≤ 2.6e-6), the mean loss too. The first AdamW step
  # moves each entry by lr · g / (|g| + ε), ±1e-3 for all but near-zero gradients, whose
  # rounding noise can move it by a fraction of lr (measured: ≤ 4.6e-5, a few entries).
  np.testing.assert_allclose(split['logits'], one['logits'], rtol=0, atol=1e-5)
  np.testing.assert_allclose(split['loss'], one['loss'], rtol=1e-6)
  params = [k for k in one if k.startswith('params/')]
  assert len(params) > 10
  for k in params:
    np.testing.assert_allclose(split[k], one[k], rtol=0, atol=1e-4, err_msg=k)
  # The rules split the decoder's params as the preset says, and the step keeps them so.
  expected = {'8x1x1': ([], [], []), '2x4x1': (['fsdp'], ['fsdp'], ['fsdp']),
              '2x2x2': (['fsdp', 'tensor'], ['fsdp', 'tensor'], ['tensor', 'fsdp'])}[mesh]
  axes = placement[f'{family}-{mesh}']
  assert (axes['blocks_0/mlp/gate/kernel'], axes['blocks_1/attn/key/kernel'],
          axes['embed/embedding']) == expected
  assert axes['final_norm/scale'] == []


LOAD = r'''
import json, sys
import numpy as np
from editing import sharding, tree as tree_lib
from editing.errors import UserError
from third_party import hf_decoder

directory, broken, out = sys.argv[1:4]
placed = {}
# (name, fsdp, tensor, preset); None: load's default rules.
for name, fsdp, tensor, preset in [('8x1x1', 1, 1, 'dp'), ('2x4x1', 4, 1, 'fsdp'),
                                   ('2x2x2', 2, 2, 'fsdp+tp'), ('default', 2, 2, None)]:
  rules = None if preset is None else sharding.logical_rules(preset)
  _, params = hf_decoder.load(directory, mesh=sharding.make_mesh(8, fsdp=fsdp, tensor=tensor),
                              sharding_rules=rules)
  flat = tree_lib.flatten(params)
  np.savez(f'{out}/{name}.npz', **flat)
  placed[name] = {p: list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
                  for p, x in flat.items()}
try:
  hf_decoder.load(broken, mesh=sharding.make_mesh(8, fsdp=4))
  placed['error'] = None
except UserError as e:
  placed['error'] = str(e)
json.dump(placed, sys.stdout)
'''
# Leaves of the tiny Llama and their splits per mesh (rows of the logical-axes table: query
# (embed, heads, head_dim), key (embed, kv_heads, head_dim), out (heads, head_dim, embed),
# down (mlp, embed), the embedding (vocab, embed), the head (embed, vocab)).
SPLITS = {
    '2x4x1': {'blocks_0/attn/query/kernel': ['fsdp', None, None],
              'blocks_1/attn/key/kernel': ['fsdp', None, None],
              'blocks_0/attn/out/kernel': [None, None, 'fsdp'],
              'blocks_1/mlp/down/kernel': [None, 'fsdp'],
              'embed/embedding': [None, 'fsdp'], 'lm_head/kernel': ['fsdp', None],
              'final_norm/scale': [None]},
    '2x2x2': {'blocks_0/attn/query/kernel': ['fsdp', 'tensor', None],
              'blocks_1/attn/key/kernel': ['fsdp', 'tensor', None],
              'blocks_0/attn/out/kernel': ['tensor', None, 'fsdp'],
              'blocks_1/mlp/down/kernel': ['tensor', 'fsdp'],
              'embed/embedding': ['tensor', 'fsdp'], 'lm_head/kernel': ['fsdp', 'tensor'],
              'final_norm/scale': [None]},
}


def _random_params(config, seed):
  rng = np.random.default_rng(seed)
  return {p: rng.normal(0, 0.3, s).astype(np.float32)
          for p, s in hf_decoder.param_shapes(config).items()}


def test_loading_onto_a_mesh_places_each_leaf_as_the_rules_say(tmp_path):
  config = DecoderConfig.from_hf(CONFIGS['llama'])
  params = _random_params(config, seed=2)
  hf_decoder.export(tree_lib.unflatten(params), config, str(tmp_path / 'model'))
  broken = dict(params)
  broken['blocks_1/mlp/up/kernel'] = broken['blocks_1/mlp/up/kernel'].copy()
  broken['blocks_1/mlp/up/kernel'][3, 5] = np.nan
  hf_decoder.export(tree_lib.unflatten(broken), config, str(tmp_path / 'broken'))
  proc = run_python(['-c', LOAD, str(tmp_path / 'model'), str(tmp_path / 'broken'),
                     str(tmp_path)], env={'XLA_FLAGS': xla_flags(devices=8)})
  placed = json.loads(proc.stdout)
  for name in ('8x1x1', '2x4x1', '2x2x2', 'default'):
    loaded = np.load(tmp_path / f'{name}.npz')
    assert sorted(loaded) == sorted(params)
    for path, value in params.items():
      np.testing.assert_array_equal(loaded[path], value, err_msg=f'{name} {path}')
  assert all(set(spec) == {None} for spec in placed['8x1x1'].values())
  for name, expected in SPLITS.items():
    assert {p: placed[name][p] for p in expected} == expected, name
  # Without rules, the fsdp+tp preset's, which uses whichever axes the mesh has.
  assert placed['default'] == placed['2x2x2']
  assert placed['error'] == (f'{tmp_path / "broken"}: blocks_1/mlp/up/kernel holds '
                             'non-finite values (NaN or infinity)')


class _Logged:
  """A stored tensor whose entries are logged into `events` when they are read."""

  def __init__(self, name, array, events):
    self.name, self.array, self.events, self.shape = name, array, events, array.shape

  def __array__(self, dtype=None, copy=None):
    del copy
    self.events.append(('read', self.name))
    return self.array if dtype is None else self.array.astype(dtype)


class _Placed:
  def __init__(self, leaf):
    self.leaf = leaf


def test_each_leaf_is_placed_before_the_next_tensor_is_read():
  config = DecoderConfig.from_hf(CONFIGS['gemma2'])
  params = _random_params(config, seed=3)
  events = []
  tensors = {name: _Logged(name, x, events)
             for name, x in hf_decoder.from_params(tree_lib.unflatten(params), config).items()}

  def place(path, leaf):
    events.append(('place', path))
    return _Placed(leaf)

  got = tree_lib.flatten(hf_decoder.to_params(tensors, config, place=place))
  assert [kind for kind, _ in events] == ['read', 'place'] * len(params)
  assert sorted(got) == sorted(params)
  for path, value in params.items():
    np.testing.assert_array_equal(got[path].leaf, value, err_msg=path)
