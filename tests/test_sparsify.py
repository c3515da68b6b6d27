"""The sparsifying merges (TIES, DARE, Breadcrumbs) and their primitives: trims, drops and bands
against plain numpy references, with ties to the earlier entry and exact counts."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import merging
from editing import cuts
from editing import tree as tree_lib
from editing.task_vector import TaskVector
from merging import dare
from merging import ops
from merging import ties
from tests import references
from tests.conftest import xla_flags
from tests.test_merging import INPUTS, TASKS, flat, random_vectors


def ties_reference(deltas, k, scope):
  """TIES written plainly over flat numpy arrays, one entry at a time where it matters."""
  paths = list(deltas[0])
  trimmed = []
  for d in deltas:
    if scope == 'global':
      values = np.concatenate([d[p].ravel() for p in paths])
      count = max(1, int(k * values.size))
      order = np.argsort(-np.abs(values), kind='stable')
      keep = np.zeros(values.size, bool)
      keep[order[:count]] = True
      pieces = np.split(np.where(keep, values, 0), np.cumsum([d[p].size for p in paths])[:-1])
      trimmed.append({p: x.reshape(d[p].shape) for p, x in zip(paths, pieces)})
    else:
      out = {}
      for p in paths:
        values = d[p].ravel()
        count = max(1, int(k * values.size))
        order = np.argsort(-np.abs(values), kind='stable')
        keep = np.zeros(values.size, bool)
        keep[order[:count]] = True
        out[p] = np.where(keep, values, 0).reshape(d[p].shape)
      trimmed.append(out)
  merged = {}
  for p in paths:
    stacked = np.stack([t[p].ravel() for t in trimmed])
    result = np.zeros(stacked.shape[1], np.float32)
    for j in range(stacked.shape[1]):
      sign = 1.0 if stacked[:, j].sum() >= 0 else -1.0
      agreeing = [x for x in stacked[:, j] if x != 0 and np.sign(x) == sign]
      result[j] = np.mean(agreeing) if agreeing else 0.0
    merged[p] = result.reshape(deltas[0][p].shape)
  return merged


@pytest.mark.parametrize('scope', ops.SCOPES)
@pytest.mark.parametrize('k', [0.1, 0.35])
def test_ties_equals_a_plain_numpy_reference(scope, k):
  vectors = random_vectors(seed=3)
  expected = ties_reference([flat(v.delta) for v in vectors], k, scope)
  merged = flat(ties.merge(vectors, density=k, scope=scope).delta)
  for path in expected:
    np.testing.assert_allclose(merged[path], expected[path], rtol=1e-6, atol=1e-7,
                               err_msg=path)


def test_ties_at_full_density_with_agreeing_signs_is_the_mean():
  vectors = [v.replace(delta=jax.tree.map(lambda d: jnp.abs(d) + 0.01, v.delta))
             for v in random_vectors()]
  merged = flat(ties.merge(vectors, density=1.0, scope='global').delta)
  mean = flat((1 / 3 * sum(vectors)).delta)
  for path in mean:
    np.testing.assert_allclose(merged[path], mean[path], rtol=1e-6, err_msg=path)


def test_ties_scopes_differ_and_trim_exact_counts():
  vector = random_vectors(tasks=('t0',))[0]
  per_tensor = flat(ops.keep_largest(vector.delta, 0.25, 'tensor'))
  whole = flat(ops.keep_largest(vector.delta, 0.25, 'global'))
  for path, mask in per_tensor.items():
    assert mask.sum() == max(1, int(0.25 * mask.size)), path
  total = sum(m.size for m in whole.values())
  assert sum(int(m.sum()) for m in whole.values()) == int(0.25 * total)
  assert any((per_tensor[p] != whole[p]).any() for p in whole)


@pytest.mark.parametrize('kept, expected', [
    # Four entries equal the threshold 2 and three fit: the earliest three, in leaf order.
    (4, {'a': [0, 1, 1, 0], 'b': [1, 0, 1]}),
    # All four fit: the case that skips the cumulative sum when eager.
    (5, {'a': [0, 1, 1, 0], 'b': [1, 1, 1]})])
def test_top_k_keeps_exact_counts_and_breaks_ties_to_the_earlier_entry(kept, expected):
  scores = {'a': jnp.array([1., 2., 2., 0.]), 'b': jnp.array([2., 2., 3.])}
  top = lambda s: tree_lib.top_k(s, lambda n: kept, 'global')
  for masks in (top(scores), jax.jit(top)(scores)):
    assert {k: np.asarray(m).astype(int).tolist() for k, m in masks.items()} == expected


def test_dare_with_p_zero_is_task_arithmetic():
  vectors = random_vectors()
  merged = flat(dare.merge(vectors, key=INPUTS['key'], p=0.0).delta)
  summed = flat(merging.get('task_arithmetic').merge(vectors).delta)
  for path in summed:
    np.testing.assert_array_equal(merged[path], summed[path], err_msg=path)


def test_dare_is_unbiased_over_keys():
  # Each entry's estimate τ(1−m)/(1−p) has variance τ²·p/(1−p); over M keys the mean of the sum
  # of T vectors has standard deviation σ = sqrt(Σ_t τ_t² · p/(1−p) / M). Allow 5σ per entry.
  vectors, p, draws = random_vectors(), 0.5, 400
  merge = jax.jit(lambda key: dare.merge(vectors, key=key, p=p).delta)
  total = None
  for i in range(draws):
    total = flat(merge(jax.random.PRNGKey(i))) if total is None else {
        k: v + flat(merge(jax.random.PRNGKey(i)))[k] for k, v in total.items()}
  summed = flat(merging.get('task_arithmetic').merge(vectors).delta)
  squares = flat(sum(v.replace(delta=jax.tree.map(jnp.square, v.delta)) for v in vectors).delta)
  for path in summed:
    sigma = np.sqrt(squares[path] * p / (1 - p) / draws)
    assert (np.abs(total[path] / draws - summed[path]) <= 5 * sigma + 1e-7).all(), path


def test_dare_masks_do_not_depend_on_vector_order():
  vectors = random_vectors()
  forward = dare.drop(vectors, [0.5] * len(vectors), INPUTS['key'])
  backward = dare.drop(vectors[::-1], [0.5] * len(vectors), INPUTS['key'])[::-1]
  for a, b in zip(forward, backward):
    for path, value in flat(a.delta).items():
      np.testing.assert_array_equal(value, flat(b.delta)[path], err_msg=path)


def test_dare_gives_the_same_bits_on_1_and_8_devices(tmp_path, run_python):
  script = tmp_path / 'dare_devices.py'
  script.write_text(
      'import sys, jax, numpy as np\n'
      'from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n'
      'from editing import tree as tree_lib\n'
      'from editing.task_vector import TaskVector\n'
      'from merging import dare\n'
      'mesh = Mesh(np.array(jax.devices()), ("data",))\n'
      'def vector(i, task):\n'
      '  x = jax.random.normal(jax.random.PRNGKey(i), (64, 24))\n'
      '  x = jax.device_put(x, NamedSharding(mesh, P("data")))\n'
      '  return TaskVector({"w": x, "b": {"v": x[0]}}, (task,), "full", "b")\n'
      'out = dare.merge([vector(0, "a"), vector(1, "b")], key=jax.random.PRNGKey(3), p=0.4)\n'
      'flat = {k: np.asarray(v) for k, v in tree_lib.flatten(out.delta).items()}\n'
      'np.savez(sys.argv[1], devices=jax.device_count(), **flat)\n')
  results = {}
  for devices in (1, 8):
    out = tmp_path / f'{devices}.npz'
    env = {'XLA_FLAGS': xla_flags(devices)}
    run_python([str(script), str(out)], env=env)
    with np.load(out) as f:
      assert int(f['devices']) == devices
      results[devices] = {k: f[k] for k in f.files if k != 'devices'}
  for k in results[1]:
    np.testing.assert_array_equal(results[8][k].view(np.uint32), results[1][k].view(np.uint32))


def tree_with_ties(seed=0):
  """Leaves of a few repeated magnitudes, both signs, keys inserted out of sorted order, so
  that ties and path order decide which entries a ranking keeps."""
  rng = np.random.default_rng(seed)
  values = lambda *shape: (rng.integers(-4, 5, shape) * 0.5).astype(np.float32)
  return {'z': values(7, 5), 'a': {'kernel': values(6, 9), 'bias': values(6)}, 'm': values(40)}


@pytest.mark.parametrize('scope', ops.SCOPES)
@pytest.mark.parametrize('density', [0.01, 0.2, 0.35, 0.5, 1.0])
def test_keep_largest_equals_a_numpy_top_k_with_ties_to_the_earlier_entry(scope, density):
  delta = tree_with_ties()
  expected = references.keep_largest(flat(delta), density, scope)
  jitted = jax.jit(lambda d: ops.keep_largest(d, density, scope))
  for masks in (ops.keep_largest(delta, density, scope),  # numpy leaves: ranked on the host
                ops.keep_largest(jax.tree.map(jnp.asarray, delta), density, scope),
                jitted(delta)):  # traced: XLA's sort
    got = flat(masks)
    assert list(got) == list(expected)  # the same paths, in the same order
    for path in expected:
      np.testing.assert_array_equal(got[path], expected[path], err_msg=(scope, path))


@pytest.mark.parametrize('top, bottom', [(0.01, 0.89), (0.1, 0.25), (0.0, 0.5), (0.3, 0.0),
                                         (0.2, 0.79)])
def test_keep_band_equals_a_numpy_band_per_leaf(top, bottom):
  delta = tree_with_ties(1)
  expected = references.keep_band(flat(delta), top, bottom)
  for masks in (ops.keep_band(delta, top, bottom),
                jax.jit(lambda d: ops.keep_band(d, top, bottom))(delta)):
    got = flat(masks)
    for path in expected:
      np.testing.assert_array_equal(got[path], expected[path], err_msg=path)
  # Breadcrumbs keeps exactly that band of each vector, and sums over vectors.
  vectors = [TaskVector(jax.tree.map(jnp.asarray, tree_with_ties(s)), (t,), 'full', 'b')
             for s, t in enumerate(TASKS[:2])]
  bands = [references.keep_band(flat(v.delta), top, bottom) for v in vectors]
  merged = flat(merging.get('breadcrumbs').merge(vectors, top=top, bottom=bottom).delta)
  for path in merged:
    np.testing.assert_array_equal(merged[path], sum(
        np.where(b[path], flat(v.delta)[path], 0) for b, v in zip(bands, vectors)),
                                  err_msg=path)


@pytest.mark.parametrize('p', [0.1, 0.3, 0.5, 0.9])
def test_dare_keeps_entries_rescaled_exactly_and_drops_a_share_p(p):
  tau = {'w': jax.random.normal(jax.random.PRNGKey(1), (512, 512)) + 1e-3, 'b': jnp.ones(16)}
  dropped = flat(ops.drop_and_rescale(tau, p, jax.random.PRNGKey(2)))
  for path, value in flat(tau).items():
    assert (value != 0).all()
    kept = dropped[path] != 0
    # τ/(1 − p) to the last bit but one: XLA on the CPU divides by a scalar as a multiplication
    # by its float32 reciprocal, one ulp off the rounded quotient in up to about a quarter of the
    # entries (never for p = 0.5, whose 1/(1 − p) = 2 is exact).
    np.testing.assert_array_max_ulp(dropped[path][kept], value[kept] / np.float32(1 - p),
                                    maxulp=0 if p == 0.5 else 1)
  # Bernoulli(p) drops over n = 2^18 entries: the share within 5σ, σ = sqrt(p(1 − p)/n).
  share = np.mean(dropped['w'] == 0)
  assert abs(share - p) <= 5 * np.sqrt(p * (1 - p) / dropped['w'].size), share


def test_dare_draws_depend_only_on_the_key_the_task_and_the_path():
  x = jax.random.normal(jax.random.PRNGKey(1), (64, 32))
  key = jax.random.PRNGKey(5)
  masks = lambda tree, k=key: {p: v != 0 for p, v in
                               flat(ops.drop_and_rescale(tree, 0.5, k)).items()}
  both = masks({'a': x, 'b': x})
  # The same values at another path draw another mask.
  assert (both['a'] != both['b']).any()
  # A leaf's draw is the same bits wherever it stands in the tree and whatever is beside it.
  for tree in ({'b': x}, {'b': x, 'c': {'d': x}}, {'a': {'b': x}, 'b': x}):
    np.testing.assert_array_equal(masks(tree)['b'], both['b'])
  # The same key gives the same bits; another key another mask.
  np.testing.assert_array_equal(masks({'a': x, 'b': x})['a'], both['a'])
  assert (masks({'a': x}, jax.random.PRNGKey(6))['a'] != both['a']).any()
  # Whole vectors: keyed by their tasks' names, not by their place in the list.
  vectors = [TaskVector({'w': x}, (t,), 'full', 'b') for t in TASKS]
  drops = [flat(v.delta)['w'] != 0 for v in dare.drop(vectors, [0.5] * len(vectors), key)]
  assert (drops[0] != drops[1]).any()
  alone = flat(dare.drop(vectors[1:2], [0.5], key)[0].delta)['w'] != 0
  np.testing.assert_array_equal(alone, drops[1])


@pytest.mark.parametrize('kind', ['normal', 'few_values', 'sorted', 'ramp_of_ties', 'with_nans'])
@pytest.mark.parametrize('share', [1e-6, 0.2, 0.5, 0.9])
def test_top_k_on_the_host_equals_the_traced_ranking_on_large_arrays(monkeypatch, kind, share):
  """A concrete array is ranked in numpy (`editing.cuts`, a chunk at a time), a traced one by
  XLA's sort: the same masks, on arrays of several chunks whose ties span them, large enough
  to be ranked from a sample (chunks and the sampled size made 16 times smaller, so that
  XLA's sort takes moments)."""
  monkeypatch.setattr(cuts, '_CHUNK', 1 << 14)
  monkeypatch.setattr(cuts, '_SAMPLED', 1 << 16)
  rng = np.random.default_rng(0)
  n = (1 << 16) + 3
  values = {'normal': rng.standard_normal(n),
            'few_values': rng.integers(0, 5, n).astype(float),
            'sorted': np.sort(rng.standard_normal(n)),
            'ramp_of_ties': np.repeat(np.arange(n // 64 + 1), 64)[:n].astype(float),
            # Both rankings put NaN above everything (so a NaN is never kept: it compares
            # false, and fewer than the count may be kept).
            'with_nans': np.where(rng.random(n) < 1e-4, np.nan, rng.standard_normal(n))}[kind]
  scores = {'a': values[:1000].astype(np.float32), 'b': values[1000:].astype(np.float32)}
  count = lambda size: max(1, int(share * size))
  for scope in ('tensor', 'global'):
    host = tree_lib.top_k(scores, count, scope)
    traced = jax.jit(lambda s, scope=scope: tree_lib.top_k(s, count, scope))(scores)
    for path in scores:
      np.testing.assert_array_equal(host[path], np.asarray(traced[path]), err_msg=(scope, path))
    if kind != 'with_nans':
      assert sum(int(m.sum()) for m in host.values()) == (
          count(n) if scope == 'global' else count(1000) + count(n - 1000))
