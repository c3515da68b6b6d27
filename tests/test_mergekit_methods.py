"""mergekit's methods (SLERP, NuSLERP, Multi-SLERP, Karcher, DELLA, SCE, Breadcrumbs-TIES, DARE's
L1 rescale) against plain numpy ports of mergekit's code, and each one's defining property."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import merging
from editing import tree as tree_lib
from editing.errors import UserError
from editing.task_vector import TaskVector
from merging import ops
from tests import references

# PyTorch-shaped leaves: `w` is read as a (outputs, inputs) matrix as it is, `b` is a vector.
SHAPES = {'w': (5, 4), 'b': (5,)}


def tree(rng, scale=1.0):
  return {p: scale * rng.normal(size=s).astype(np.float32) for p, s in SHAPES.items()}


def vectors(count, seed=0, scale=0.3):
  rng = np.random.default_rng(seed)
  return [TaskVector(tree(rng, scale), (f't{i}',), 'full', 'base') for i in range(count)]


THETA0 = tree(np.random.default_rng(99))


def merged(name, vs, **kwargs):
  method = merging.get(name)
  inputs = {'theta0': THETA0, 'key': jax.random.PRNGKey(4)}
  out = method.merge(vs, **{k: inputs[k] for k in method.reads},
                     **{**merging.check_settings(name, {}, name), **kwargs})
  return {p: np.asarray(x) for p, x in out.delta.items()}


def deltas(vs):
  return [{p: np.asarray(x, np.float64) for p, x in v.delta.items()} for v in vs]


# Ports of mergekit's functions (merge_methods/{nuslerp,multislerp,karcher,sce}.py).

def nuslerp_reference(t, v0, v1, dim=-1, flatten=False):
  shape = v0.shape
  if flatten:
    v0, v1 = v0.reshape(-1), v1.reshape(-1)
  elif dim != -1:
    v0, v1 = np.swapaxes(v0, dim, -1), np.swapaxes(v1, dim, -1)
  unit = lambda x: x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-7)
  cos = np.sum(unit(v0) * unit(v1), axis=-1, keepdims=True)
  theta = np.arccos(np.clip(cos, -1, 1))
  sin = np.sin(theta)
  with np.errstate(divide='ignore', invalid='ignore'):
    res = (np.sin((1 - t) * theta) * v0 + np.sin(t * theta) * v1) / sin
  colinear = np.broadcast_to(np.abs(sin) < 1e-8, res.shape)
  res = np.where(colinear, (1 - t) * v0 + t * v1, res)
  if dim != -1 and not flatten:
    res = np.swapaxes(res, dim, -1)
  return res.reshape(shape)


def multislerp_reference(xs, weights, eps=1e-8):
  flat = np.stack([x.reshape(-1) for x in xs])
  w = np.asarray(weights, np.float64) / np.sum(weights)
  norms = np.linalg.norm(flat, axis=-1, keepdims=True)
  units = flat / (norms + eps)
  mean = (units * w[:, None]).sum(0)
  mean = mean / np.linalg.norm(mean)
  tangent = ((units - (units @ mean)[:, None] * mean) * w[:, None]).sum(0)
  norm = np.linalg.norm(tangent) + eps
  result = mean * np.cos(norm) + tangent * (np.sin(norm) / norm)
  return (result * (norms[:, 0] * w).sum()).reshape(xs[0].shape)


def karcher_reference(xs, max_iter=10, tol=1e-5):
  alphas = [1 / len(xs)] * len(xs)
  norms = [np.linalg.norm(x) for x in xs]
  units = [x / n for x, n in zip(xs, norms)]
  u = sum(a * x for a, x in zip(alphas, units))
  u = u / np.linalg.norm(u)
  for _ in range(max_iter):
    step = np.zeros_like(u)
    for a, x in zip(alphas, units):
      dot = np.clip(np.sum(u * x), -1, 1)
      theta = np.arccos(dot)
      if theta >= tol:
        step += a * (theta / np.sin(theta)) * (x - dot * u)
    length = np.linalg.norm(step)
    if length < tol:
      break
    u = np.cos(length) * u + np.sin(length) * step / length
    u = u / np.linalg.norm(u)
  return sum(a * n for a, n in zip(alphas, norms)) * u


def sce_reference(taus, select_topk):
  tvs = np.stack(taus)
  if select_topk < 1:
    var = np.var(tvs, axis=0)
    k = int(np.count_nonzero(var) * select_topk)
    mask = np.zeros(var.size)
    mask[np.argsort(-var.reshape(-1), kind='stable')[:k]] = 1
    tvs = tvs * mask.reshape(var.shape)[None]
  majority = np.where(tvs.sum(0) >= 0, 1, -1)
  erase = np.sign(tvs) == majority
  weights = np.mean(tvs.reshape(len(taus), -1) ** 2, axis=1)
  weights = weights / weights.sum()
  erased = weights.reshape((-1,) + (1,) * (tvs.ndim - 1)) * erase
  return (tvs * erased).sum(0) / np.maximum(erased.sum(0), 1e-6)


@pytest.mark.parametrize('t', [0.0, 0.3, 1.0])
def test_slerp_follows_mergekits_formula(t):
  vs = vectors(1, scale=2.0)
  out = merged('slerp', vs, t=t)
  for p, x0 in THETA0.items():
    expected = references.slerp(t, x0, x0 + deltas(vs)[0][p]) - x0
    np.testing.assert_allclose(out[p], expected, rtol=1e-4, atol=1e-5, err_msg=p)


def test_slerp_stays_on_the_great_circle_and_lerps_nearly_colinear_tensors():
  a, b = np.eye(2, dtype=np.float32)
  vector = TaskVector({'v': b - a, 'u': np.full(2, 1e-3, np.float32)}, ('t0',), 'full', 'base')
  theta0 = {'v': a, 'u': np.ones(2, np.float32)}
  for t in (0.25, 0.5):
    out = merging.get('slerp').merge([vector], theta0=theta0, t=t).delta
    point = theta0['v'] + np.asarray(out['v'])
    np.testing.assert_allclose(point, [math.cos(t * math.pi / 2), math.sin(t * math.pi / 2)],
                               atol=1e-6)
    # [1, 1] and [1.001, 1.001] are colinear: the lerp, t·τ.
    np.testing.assert_allclose(out['u'], t * 1e-3, rtol=1e-4)


def test_slerp_takes_one_model():
  with pytest.raises(UserError, match='slerp merges one fine-tuned model into the base; got 2'):
    merged('slerp', vectors(2))


@pytest.mark.parametrize('flatten, row_wise, task_space', [
    (True, False, True), (False, False, True), (False, True, True), (False, False, False)])
def test_nuslerp_follows_mergekits_code(flatten, row_wise, task_space):
  vs = vectors(2)
  out = merged('nuslerp', vs, weights=[1.0, 3.0], flatten=flatten, row_wise=row_wise,
               task_space=task_space)
  d = deltas(vs)
  for p, x0 in THETA0.items():
    x0 = x0.astype(np.float64)
    ends = (d[0][p], d[1][p]) if task_space else (x0 + d[0][p], x0 + d[1][p])
    expected = nuslerp_reference(0.75, *ends, dim=0 if row_wise else -1, flatten=flatten)
    expected = expected if task_space else expected - x0
    np.testing.assert_allclose(out[p], expected, rtol=1e-4, atol=1e-5, err_msg=p)


def test_nuslerp_of_orthogonal_rows_keeps_each_row_on_its_circle():
  a = np.eye(3, dtype=np.float32)
  b = np.roll(a, 1, axis=1)  # row i of b is orthogonal to row i of a
  vs = [TaskVector({'w': x}, (f't{i}',), 'full', 'base') for i, x in enumerate((a, b))]
  out = np.asarray(merging.get('nuslerp').merge(
      vs, theta0={'w': np.zeros((3, 3), np.float32)}, flatten=False, row_wise=False,
      task_space=True).delta['w'])
  np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(out, (a + b) / math.sqrt(2), rtol=1e-6)


@pytest.mark.parametrize('task_space', [True, False])
def test_multislerp_follows_mergekits_code(task_space):
  vs, weights = vectors(3), [1.0, 2.0, 0.5]
  out = merged('multislerp', vs, weights=weights, task_space=task_space)
  d = deltas(vs)
  for p, x0 in THETA0.items():
    x0 = x0.astype(np.float64)
    if task_space:
      expected = multislerp_reference([x[p] for x in d], weights)
    else:
      expected = multislerp_reference([x0 + x[p] for x in d], weights) - x0
    np.testing.assert_allclose(out[p], expected, rtol=1e-4, atol=1e-5, err_msg=p)


def test_multislerp_of_two_equals_slerp_halfway_and_refuses_cancelling_weights():
  vs = vectors(2)
  out = merged('multislerp', vs, task_space=True)
  d = deltas(vs)
  for p in THETA0:
    # Equal weights: the midpoint of the arc, at the mean norm.
    direction = references.slerp(0.5, d[0][p] / np.linalg.norm(d[0][p]),
                                 d[1][p] / np.linalg.norm(d[1][p]))
    mean_norm = (np.linalg.norm(d[0][p]) + np.linalg.norm(d[1][p])) / 2
    np.testing.assert_allclose(out[p], mean_norm * direction, rtol=1e-4, atol=1e-6, err_msg=p)
  x = vs[0]
  opposite = [x, x.replace(delta=jax.tree.map(jnp.negative, x.delta), tasks=('t1',)),
              x.replace(tasks=('t2',))]
  with pytest.raises(UserError, match='multislerp: the weighted mean of the directions'):
    merged('multislerp', opposite, weights=[1.0, 2.0, 1.0], task_space=True)


@pytest.mark.parametrize('task_space', [True, False])
def test_karcher_follows_mergekits_code(task_space):
  vs = vectors(3)
  out = merged('karcher', vs, task_space=task_space)
  d = deltas(vs)
  for p, x0 in THETA0.items():
    x0 = x0.astype(np.float64)
    if task_space:
      expected = karcher_reference([x[p] for x in d])
    else:
      expected = karcher_reference([x0 + x[p] for x in d]) - x0
    np.testing.assert_allclose(out[p], expected, rtol=1e-4, atol=1e-5, err_msg=p)


def test_karcher_mean_of_two_is_the_midpoint_of_their_arc():
  a, b = np.eye(2, dtype=np.float32)
  vs = [TaskVector({'v': x}, (f't{i}',), 'full', 'base') for i, x in enumerate((a, 3 * b))]
  out = merging.get('karcher').merge(vs, theta0={'v': np.zeros(2, np.float32)}, max_iter=10,
                                     tol=1e-5, task_space=True).delta['v']
  np.testing.assert_allclose(out, 2.0 * np.array([1.0, 1.0]) / math.sqrt(2), rtol=1e-5)


def nearswap_reference(t, v0, v1):
  """mergekit's nearswap (merge_methods/nearswap.py), in numpy: v0 the base's weights."""
  with np.errstate(divide='ignore', invalid='ignore'):
    weight = t / np.abs(v0 - v1)
  weight = np.clip(np.nan_to_num(weight, nan=1.0, posinf=1.0, neginf=1.0), 0.0, 1.0)
  return weight * v1 + (1 - weight) * v0


@pytest.mark.parametrize('t', [1e-3, 0.1, 0.3, 10.0])
def test_nearswap_follows_mergekits_code(t):
  vs = vectors(1)
  vs[0].delta['b'][:2] = 0.0  # equal in both models: t/0, which mergekit makes a weight of 1
  out = merged('nearswap', vs, t=t)
  for p, x0 in THETA0.items():
    expected = nearswap_reference(t, x0.astype(np.float64), x0 + deltas(vs)[0][p]) - x0
    np.testing.assert_allclose(out[p], expected, rtol=1e-5, atol=1e-6, err_msg=p)


def test_nearswap_takes_the_near_entries_whole_and_clips_the_far_ones_to_t():
  vs = vectors(1)
  t = 0.2
  out = merged('nearswap', vs, t=t)
  for p, tau in deltas(vs)[0].items():
    near = np.abs(tau) <= t
    assert near.any() and (~near).any()
    np.testing.assert_array_equal(out[p][near], vs[0].delta[p][near])
    np.testing.assert_allclose(out[p][~near], t * np.sign(tau[~near]), rtol=1e-6)
  with pytest.raises(UserError, match='nearswap merges one fine-tuned model into the base; '
                                      'got 2'):
    merged('nearswap', vectors(2))


def arcee_fusion_reference(v0, v1):
  """mergekit's arcee_fusion (merge_methods/arcee_fusion.py) in numpy, on a tensor of at most
  10^6 entries (which mergekit does not sample): v0 the base's weights, rows its last axis."""
  def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
  p, q = softmax(v1) + 1e-8, softmax(v0) + 1e-8
  scores = np.abs(v1 - v0) * np.sum(p * np.log(p / q), axis=-1)[..., None]
  ordered = np.sort(scores.reshape(-1))
  q1, median, q3 = (ordered[int(q * (ordered.size - 1))] for q in (0.25, 0.5, 0.75))
  return v0 + (v1 - v0) * (scores >= median + 1.5 * (q3 - q1))


def test_arcee_fusion_follows_mergekits_code():
  """Rows of 40 entries, so that each tensor has a few outliers of its importance; scale 2, so
  that the rows' softmaxes move."""
  rng = np.random.default_rng(3)
  theta0 = {'w': rng.normal(size=(30, 40)).astype(np.float32),
            'b': rng.normal(size=(40,)).astype(np.float32)}
  vector = TaskVector({p: 2 * rng.standard_t(3, size=x.shape).astype(np.float32)
                       for p, x in theta0.items()}, ('t0',), 'full', 'base')
  out = merging.get('arcee_fusion').merge([vector], theta0=theta0).delta
  for p, x0 in theta0.items():
    tau = np.asarray(vector.delta[p])
    expected = arcee_fusion_reference(x0.astype(np.float64), x0 + tau.astype(np.float64)) - x0
    kept = np.asarray(out[p]) != 0
    # Each entry is τ's or none: the mask decides, and it is mergekit's.
    np.testing.assert_array_equal(np.asarray(out[p])[kept], tau[kept], err_msg=p)
    np.testing.assert_array_equal(kept, expected != 0, err_msg=p)
    assert 0 < kept.mean() < 0.5, (p, kept.mean())
  with pytest.raises(UserError, match='arcee_fusion merges one fine-tuned model into the base; '
                                      'got 2'):
    merged('arcee_fusion', vectors(2))


def test_della_keep_probabilities_follow_the_rank_of_each_magnitude_in_its_row():
  rows = np.array([[0.3, -2.0, 0.1, 1.0], [5.0, 4.0, -3.0, 0.0]], np.float32)
  p = np.asarray(ops.rank_spread(jnp.abs(rows), 0.5, 0.2))
  ranks = np.argsort(np.argsort(np.abs(rows), axis=1, kind='stable'), axis=1)
  np.testing.assert_allclose(p, 0.3 + 0.4 * ranks / 3, rtol=1e-6)


def test_della_draws_with_those_probabilities_and_merges_as_mergekit():
  vs, weights = vectors(3), [1.0, 0.5, 2.0]
  key = jax.random.PRNGKey(4)
  out = merged('della', vs, weights=weights, density=0.4, epsilon=0.1)
  expected_pruned = []
  for v, d in zip(vs, deltas(vs)):
    vector_key = jax.random.fold_in(key, tree_lib.stable_hash(','.join(v.tasks)))
    pruned = {}
    for p, x in d.items():
      rows = x.reshape(x.shape[0] if x.ndim > 1 else 1, -1)
      ranks = np.argsort(np.argsort(np.abs(rows), axis=1, kind='stable'), axis=1)
      prob = 0.3 + 0.2 * ranks / (rows.shape[1] - 1)
      # Entry i's uniform is jax's, from the leaf's key folded with i; the rest is numpy's.
      leaf_key = jax.random.fold_in(vector_key, tree_lib.stable_hash(p))
      words = np.asarray(jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(
          leaf_key, jnp.arange(rows.size, dtype=jnp.uint32))))[:, 0]
      uniform = ((words >> 9).astype(np.float32) * 2.0**-23).reshape(rows.shape)
      kept = uniform < prob.astype(np.float32)
      pruned[p] = np.where(kept, rows / prob, 0.0).reshape(x.shape)
    expected_pruned.append(pruned)
  for p in THETA0:
    weighted = np.stack([w * e[p] for w, e in zip(weights, expected_pruned)])
    sign = np.where(weighted.sum(0) >= 0, 1, -1)
    agree = (np.sign(weighted) == sign) & (weighted != 0)
    divisor = (agree * np.reshape(weights, (-1,) + (1,) * (weighted.ndim - 1))).sum(0)
    expected = (weighted * agree).sum(0) / np.where(divisor == 0, 1, divisor)
    np.testing.assert_allclose(out[p], expected, rtol=1e-4, atol=1e-6, err_msg=p)


def test_della_rescales_without_bias_or_to_the_l1_norm():
  v = TaskVector({'w': np.random.default_rng(1).normal(size=(4, 50)).astype(np.float32)},
                 ('t0',), 'full', 'base')
  runs = [np.asarray(ops.drop_and_rescale(v.delta, 0.5, jax.random.PRNGKey(k), 'probability',
                                          0.3)['w']) for k in range(400)]
  # 1/p_r rescaling keeps every entry's expectation: the mean of 400 draws is near τ.
  error = np.abs(np.mean(runs, axis=0) - v.delta['w']) / np.abs(v.delta['w'])
  assert np.median(error) < 0.1, np.median(error)
  kept_share = np.mean([r != 0 for r in runs])
  assert abs(kept_share - 0.5) < 0.01, kept_share
  l1 = np.asarray(ops.drop_and_rescale(v.delta, 0.5, jax.random.PRNGKey(0), 'l1_norm', 0.3)['w'])
  np.testing.assert_allclose(np.abs(l1).sum(), np.abs(v.delta['w']).sum(), rtol=1e-5)


def test_della_refuses_probabilities_outside_zero_one():
  with pytest.raises(UserError, match='density ± epsilon must lie in'):
    merging.check_settings('della', {'density': 0.1, 'epsilon': 0.15}, 'config.della')


@pytest.mark.parametrize('select_topk', [1.0, 0.4])
def test_sce_follows_mergekits_code(select_topk):
  vs = vectors(3)
  out = merged('sce', vs, select_topk=select_topk)
  d = deltas(vs)
  for p in THETA0:
    np.testing.assert_allclose(out[p], sce_reference([x[p] for x in d], select_topk),
                               rtol=1e-4, atol=1e-6, err_msg=p)


def test_sce_keeps_the_entries_that_vary_most_across_models():
  # Entry 0 is the same in both vectors (no variance); entries 1, 2, 3 vary by 1, 3 and 2.
  first = np.array([1.0, 1.0, 1.0, 1.0], np.float32)
  second = first + np.array([0.0, 1.0, 3.0, 2.0], np.float32)
  vs = [TaskVector({'v': x}, (f't{i}',), 'full', 'b') for i, x in enumerate((first, second))]
  # k = ⌊3 · 0.7⌋ = 2 of the 3 varying entries: the two that vary most, 2 and 3.
  out = np.asarray(merging.get('sce').merge(vs, select_topk=0.7).delta['v'])
  assert (out[:2] == 0).all() and (out[2:] > 0).all(), out
  # Every kept entry agrees in sign: the energy-weighted mean of the two, w ∝ mean τ².
  energy = np.array([np.mean(np.where([0, 0, 1, 1], x, 0) ** 2) for x in (first, second)])
  w = energy / energy.sum()
  np.testing.assert_allclose(out[2:], w[0] * first[2:] + w[1] * second[2:], rtol=1e-6)


def test_breadcrumbs_ties_weights_and_elects_signs_as_mergekit():
  vs, weights = vectors(3), [1.0, 0.5, 2.0]
  out = merged('breadcrumbs', vs, top=0.1, bottom=0.3, elect_sign=True, normalize=False,
               weights=weights)
  d = deltas(vs)
  for p in THETA0:
    kept = [references.keep_band({p: x[p]}, 0.1, 0.3)[p] for x in d]
    weighted = np.stack([w * np.where(k, x[p], 0) for w, k, x in zip(weights, kept, d)])
    sign = np.where(weighted.sum(0) >= 0, 1, -1)
    agree = (np.sign(weighted) == sign) & (weighted != 0)
    np.testing.assert_allclose(out[p], (weighted * agree).sum(0), rtol=1e-5, atol=1e-7,
                               err_msg=p)


def mergekit_outliers(x: np.ndarray, density: float, gamma: float) -> np.ndarray:
  """A numpy port of mergekit's magnitude_outliers mask: sorted ascending by |x|, the
  ⌊d·n⌋ entries above the n − ⌊d·n⌋ − ⌊γ·n⌋ smallest (none dropped below 0)."""
  n = x.size
  if density >= 1:
    return np.ones(x.shape, bool)
  target, top = int(density * n), int(gamma * n)
  bottom = max(0, n - target - top)
  mask = np.zeros(n, bool)
  mask[np.argsort(np.abs(x).ravel(), kind='stable')[bottom:bottom + target]] = True
  return mask.reshape(x.shape)


@pytest.mark.parametrize('n, density, gamma', [(37, 0.3, 0.05), (100, 0.1, 0.01),
                                               (19, 0.9, 0.2), (7, 0.5, 0.0), (50, 1.0, 0.1)])
def test_breadcrumbs_with_density_keeps_mergekits_outliers_band(n, density, gamma):
  """mergekit's (density, gamma) counted as mergekit counts them, also where d + γ > 1 (fewer of
  the largest dropped) and where ⌊γ·n⌋ = 0."""
  x = np.random.default_rng(n).normal(size=(n,)).astype(np.float32)
  v = TaskVector({'v': x}, ('t',), 'full', 'b')
  out = merged('breadcrumbs', [v], top=gamma, bottom=0.0, density=density, elect_sign=False,
               normalize=False)['v']
  np.testing.assert_array_equal(out != 0, mergekit_outliers(x, density, gamma))


def test_breadcrumbs_refuses_density_with_a_lower_edge_of_its_own():
  with pytest.raises(UserError, match='bottom 0 where density is given'):
    merging.check_settings('breadcrumbs', {'density': 0.3, 'bottom': 0.5}, 'config.breadcrumbs')


def test_dare_l1_rescale_keeps_each_tensors_l1_norm():
  v = vectors(1)[0]
  dropped = ops.drop_and_rescale(v.delta, 0.7, jax.random.PRNGKey(3), 'l1_norm')
  for p, x in v.delta.items():
    kept = np.asarray(dropped[p]) != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(np.abs(np.asarray(dropped[p])).sum(), np.abs(x).sum(),
                               rtol=1e-5, err_msg=p)
    ratio = np.asarray(dropped[p])[kept] / x[kept]  # one factor for the whole tensor
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-5)


def model_stock_reference(x0, xs, filter_wise):
  """mergekit's model_stock.py in numpy: t from the mean pairwise cosine of the offsets, per
  row along the last axis where `filter_wise` (a vector is one row), else over the tensor."""
  shape = x0.shape
  if filter_wise:
    x0, xs = np.atleast_2d(x0), [np.atleast_2d(x) for x in xs]
  else:
    x0, xs = x0.reshape(-1), [x.reshape(-1) for x in xs]
  offsets = [x - x0 for x in xs]
  cosines = []
  for i in range(len(offsets)):
    for j in range(i + 1, len(offsets)):
      product = np.linalg.norm(offsets[i], axis=-1) * np.linalg.norm(offsets[j], axis=-1)
      cosines.append(np.clip((offsets[i] * offsets[j]).sum(-1) / np.maximum(product, 1e-6),
                             -1, 1))
  cos = np.mean(cosines, axis=0)[..., None]
  n = len(xs)
  t = n * cos / (1 + (n - 1) * cos)
  return (t * sum(xs) / n + (1 - t) * x0).reshape(shape)


@pytest.mark.parametrize('filter_wise', [False, True])
def test_model_stock_follows_mergekits_code(filter_wise):
  """Three vectors whose rows share a direction to different degrees: per-row t differs from
  the whole tensor's, and each follows mergekit's formula."""
  vs = vectors(3)
  out = merged('model_stock', vs, clip=False, filter_wise=filter_wise)
  for p, x0 in THETA0.items():
    thetas = [x0.astype(np.float64) + d[p] for d in deltas(vs)]
    expected = model_stock_reference(x0.astype(np.float64), thetas, filter_wise) - x0
    np.testing.assert_allclose(out[p], expected, rtol=1e-4, atol=1e-5, err_msg=p)
  whole = merged('model_stock', vs, clip=False, filter_wise=not filter_wise)
  assert np.abs(whole['w'] - out['w']).max() > 1e-3  # a matrix's rows take their own t
  np.testing.assert_allclose(whole['b'], out['b'], rtol=1e-5)  # a vector is one row
