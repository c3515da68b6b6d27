"""Merging methods: contracts every method keeps, and each method's defining property."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import merging
from editing import tree as tree_lib
from editing.errors import UserError
from editing.task_vector import TaskVector
from merging import adamerging
from merging import common
from merging import consensus
from merging import dam
from merging import dare
from merging import fisher
from merging import ops
from merging import regmean
from tests import references

TASKS = ('t0', 't1', 't2')


class TinyNet(nn.Module):
  """Two Dense layers, so that RegMean has linear layers to merge and Fisher gradients to read."""

  @nn.compact
  def __call__(self, x):
    hidden = jnp.tanh(nn.Dense(6, name='hidden')(x))
    return nn.Dense(3, name='out')(hidden)


NET = TinyNet()
THETA0 = NET.init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))['params']
APPLY = lambda params, x: NET.apply({'params': params}, x)


def random_vectors(seed=0, scale=0.1, tasks=TASKS, regime='full'):
  leaves, treedef = jax.tree.flatten(THETA0)
  vectors = []
  for i, task in enumerate(tasks):
    keys = jax.random.split(jax.random.PRNGKey(seed * 100 + i), len(leaves))
    delta = jax.tree.unflatten(treedef, [scale * jax.random.normal(k, x.shape)
                                         for k, x in zip(keys, leaves)])
    vectors.append(TaskVector(delta, (task,), regime, 'base'))
  return vectors


def task_data(labels=True, n=24):
  rng = np.random.default_rng(0)
  return {t: common.TaskData(APPLY, rng.normal(size=(n, 4)).astype(np.float32),
                           rng.integers(0, 3, n).astype(np.int32) if labels else None)
          for t in TASKS}


def trigger(x):
  """A toy trigger for the oracle: the last input feature set high."""
  return np.concatenate([x[:, :-1], np.full_like(x[:, -1:], 3.0)], axis=-1)


INPUTS = {'key': jax.random.PRNGKey(7), 'theta0': THETA0, 'apply_fn': APPLY, 'trigger': trigger}
# Fast settings per method; AdaMerging and DAM take few steps here.
_DAM = dict(steps=2, refit_steps=2)
SETTINGS = {'adamerging_task': dict(steps=3), 'adamerging_layer': dict(steps=3),
            'dam': _DAM, 'dam_shared': _DAM, 'dam_safe': _DAM, 'dam_oracle': _DAM,
            'fisher': dict(batch_size=8), 'regmean': dict(batch_size=8),
            'regmean_plusplus': dict(batch_size=8)}


def run(name, vectors, data=None, **overrides):
  """Method `name` merging `vectors` (the first of them, for a method that takes a fixed
  number fewer) with the fast settings."""
  method = merging.get(name)
  all_vectors = overrides.pop('all_vectors', False)
  if method.vectors is not None and not all_vectors:
    vectors = vectors[:method.vectors]
  inputs = dict(INPUTS, data=data if data is not None else task_data())
  kwargs = {k: inputs[k] for k in method.reads}
  return method.merge(vectors, **kwargs, **{**SETTINGS.get(name, {}), **overrides})


# The methods that merge dense deltas into vectors; the LoRA-space ones:
# tests/test_lora_merges.py; those whose merge is a routed model: tests/test_wemoe.py.
DENSE = sorted(n for n, m in merging.REGISTRY.items() if not m.low_rank and not m.forward)


def flat(tree):
  return {k: np.asarray(v) for k, v in tree_lib.flatten(tree).items()}


def each_vector(name, merged) -> list:
  """A per-task method's vectors (one per task, in order), or the one merged vector, as a
  list."""
  return list(merged) if merging.get(name).per_task else [merged]


@pytest.mark.parametrize('name', DENSE)
def test_merged_vector_keeps_provenance_and_zero_lambda_is_the_base(name):
  vectors = random_vectors()
  merged = each_vector(name, run(name, vectors))
  # A per-task method's vector k is task k's own.
  tasks = ([(t,) for t in TASKS] if merging.get(name).per_task
           else [TASKS[:merging.get(name).vectors]])
  assert [m.tasks for m in merged] == tasks
  for vector in merged:
    assert vector.regime == 'full' and vector.base == 'base'
    assert jax.tree.structure(vector.delta) == jax.tree.structure(THETA0)
    for path, value in flat(vector.apply_to(THETA0, 0.0)).items():
      np.testing.assert_array_equal(value.view(np.uint32), flat(THETA0)[path].view(np.uint32))


# The methods whose defaults interpolate the models' weights rather than the task vectors.
WEIGHT_SPACE = ('slerp', 'karcher')


@pytest.mark.parametrize('name', DENSE)
def test_zero_task_vectors_merge_to_zero(name):
  zeros = [v.replace(delta=jax.tree.map(jnp.zeros_like, v.delta)) for v in random_vectors()]
  for vector in each_vector(name, run(name, zeros)):
    for path, value in flat(vector.delta).items():
      # RegMean(++) solves a linear system for W0 itself, and the interpolations of weights
      # take θ0 + 0 through float32 arithmetic: both land on zero up to rounding.
      rounded = name.startswith('regmean') or name in WEIGHT_SPACE
      np.testing.assert_allclose(value, 0.0, atol=1e-5 if rounded else 0, err_msg=path)


def single_vector_output(name, vector):
  """What each method documents for one task vector in, at its defaults, from plain numpy."""
  tau = flat(vector.delta)
  if name in ('averaging', 'task_arithmetic', 'fisher', 'regmean', 'regmean_plusplus', 'magmax',
              'multislerp', 'karcher'):
    return tau
  if name in ('della', 'sce'):  # density 1 keeps all; the one vector's sign agrees with itself
    return tau
  if name == 'slerp':  # halfway along the great circle from θ0 to θ0 + τ
    base = flat(THETA0)
    return {p: references.slerp(0.5, base[p], base[p] + t) - base[p] for p, t in tau.items()}
  if name == 'tsv_m':  # k = ⌊r/1⌋: every triplet of its own SVD, U Σ Vᵀ = τ
    return tau
  if name == 'wudi':  # started at Σ τ_t = τ, where the interference and its gradient are 0
    return tau
  if name == 'cart':  # one vector is its own average: nothing is left to centre
    return tau
  if name in ('iso_c', 'iso_cts'):
    # σ̄·UVᵀ of each kernel (the same for W and Wᵀ), biases as they are. Iso-CTS's common
    # subspace (k) and the one task's own (s = r − k) span the whole rank: Iso-C's.
    out = dict(tau)
    for path, t in tau.items():
      if path.endswith('kernel'):
        u, sigma, vt = np.linalg.svd(t.astype(np.float64), full_matrices=False)
        out[path] = sigma.mean() * u @ vt
    return out
  if name == 'ties':  # the disjoint mean of one vector is its trimmed self (k = 20%, global)
    keep = references.keep_largest(tau, 0.2, 'global')
    return {p: np.where(keep[p], t, 0) for p, t in tau.items()}
  if name == 'dataless_localize_stitch':  # its region, the top 10% of |τ| (global), alone
    keep = references.keep_largest(tau, 0.1, 'global')
    return {p: np.where(keep[p], t, 0) for p, t in tau.items()}
  if name == 'breadcrumbs':  # per leaf, all but the top 1% and the bottom 89% of |τ|
    keep = references.keep_band(tau, 0.01, 0.89)
    return {p: np.where(keep[p], t, 0) for p, t in tau.items()}
  if name == 'nearswap':  # each entry's magnitude clipped to t = 1e-3, its sign kept
    return {p: np.sign(t) * np.minimum(np.abs(t), np.float32(1e-3)) for p, t in tau.items()}
  if name == 'consensus':  # no entry is used by min_tasks = 2 tasks
    return {k: np.zeros_like(v) for k, v in tau.items()}
  if name == 'negation':
    return {p: -t for p, t in tau.items()}
  if name == 'extract':
    return tau
  if name == 'emr':  # one task elects its own signs and magnitudes, rescaled by 1
    return tau
  if name == 'tall_masks':  # |τ| ≥ λ·|τ − τ| = 0 everywhere: the whole τ_MTL = τ
    return tau
  raise AssertionError(name)


def assert_dam_rescales_each_entry(name, merged, tau):
  """DAM's output for one vector is λ·M⊙τ with M > 0 a product of masks that each have mean 1
  per leaf: r = merged/τ is positive and varies within a leaf (the masks learned something);
  with one mask, r's mean over every leaf is the same number, the one λ."""
  ratios = {p: merged[p] / t for p, t in tau.items()}
  for path, r in ratios.items():
    assert np.isfinite(r).all() and (r > 0).all(), f'{name} {path}: {r}'
  assert any(np.ptp(r) > 1e-4 * r.mean() for r in ratios.values()), \
      f'{name}: masks that learned nothing'
  if name in ('dam_shared', 'dam_safe'):
    means = [r.mean() for r in ratios.values()]
    np.testing.assert_allclose(means, means[0], rtol=1e-5, err_msg=name)


@pytest.mark.parametrize('name', DENSE)
def test_one_task_vector_in_gives_the_documented_output(name):
  vector = random_vectors(tasks=('t0',))[0]
  tau = flat(vector.delta)
  if name == 'model_stock':  # its ratio is set by the angle between vectors: none for one
    with pytest.raises(UserError, match='model_stock needs at least 2 task vectors'):
      run(name, [vector])
    return
  if name == 'nuslerp':
    with pytest.raises(UserError, match='nuslerp interpolates two models; got 1'):
      run(name, [vector])
    return
  merged = flat(each_vector(name, run(name, [vector], task_data()))[0].delta)
  if name.startswith('adamerging'):
    # λ·τ with λ learned: a multiple of τ, per vector or per leaf.
    for path, value in tau.items():
      ratio = merged[path].ravel()[0] / value.ravel()[0]
      np.testing.assert_allclose(merged[path], ratio * value, rtol=1e-5, err_msg=path)
    return
  if name.startswith('dam'):
    assert_dam_rescales_each_entry(name, merged, tau)
    return
  if name == 'arcee_fusion':
    # Its importance outliers (against mergekit's code: tests/test_mergekit_methods.py): each
    # entry is τ's or zero, and both occur.
    kept = {p: merged[p] != 0 for p in tau}
    for path, value in tau.items():
      np.testing.assert_array_equal(merged[path][kept[path]], value[kept[path]], err_msg=path)
    share = np.mean(np.concatenate([k.ravel() for k in kept.values()]))
    assert 0 < share < 1, share
    return
  if name == 'localize_stitch':
    # One task's learned region, stitched alone (its steps against numpy:
    # tests/test_localize_stitch.py): each entry is τ's or zero.
    for path, value in tau.items():
      kept = merged[path] != 0
      np.testing.assert_array_equal(merged[path][kept], value[kept], err_msg=path)
    return
  if name == 'dare':
    # Its draws are jax's, not reproducible in numpy: every entry is dropped (0) or kept and
    # rescaled by 1/(1 − p) exactly, p = 0.5 by default; both happen on 51 entries.
    kept = {p: merged[p] != 0 for p in tau}
    for path, value in tau.items():
      np.testing.assert_array_equal(merged[path][kept[path]],
                                    value[kept[path]] / np.float32(1 - 0.5), err_msg=path)
    share = np.mean(np.concatenate([k.ravel() for k in kept.values()]))
    assert 0 < share < 1, share
    return
  expected = single_vector_output(name, vector)
  for path in expected:
    np.testing.assert_allclose(merged[path], expected[path], rtol=1e-4, atol=1e-6,
                               err_msg=f'{name} {path}')


def test_dam_with_saturated_masks_and_a_still_lambda_is_the_initial_lambda_times_tau():
  # Logits of +50 give σ = 1 in float32 whatever the Concrete noise (|log-odds| ≤ 14), so
  # every mask is all ones and stays so (its gradient is 0); Adam moves λ by about its
  # learning rate, 1e-30, which float32 cannot add to 0.3. So the merge is 0.3·τ, bit for bit.
  vector = random_vectors(tasks=('t0',))[0]
  # (One variant: the others compose their masks the same way, and each costs a compile.)
  merged = flat(run('dam', [vector], mask_init=50.0, init=0.3, learning_rate=1e-30).delta)
  for path, value in flat(vector.delta).items():
    np.testing.assert_array_equal(merged[path], np.float32(0.3) * value, err_msg=path)


@pytest.mark.parametrize('name, masks', [
    ('dam', {'shared', 'safe'}), ('dam_oracle', {'shared', 'safe'}),
    ('dam_shared', {'shared'}), ('dam_safe', {'safe'})])
def test_dam_learns_its_masks_each_with_mean_one_per_leaf(name, masks):
  """The paper's two masks (or the ablation's one), each m/mean(m) of σ(ℓ) per tensor."""
  vector = random_vectors(tasks=('t0',))[0]
  method = merging.get(name)
  inputs = dict(INPUTS, data=task_data())
  learned = dam.learn([vector], **{k: inputs[k] for k in method.reads},
                      **getattr(method.merge, 'keywords', {}), **SETTINGS[name])
  assert set(learned.masks) == masks
  for mask_name, mask in learned.masks.items():
    for path, value in flat(mask).items():
      assert (value > 0).all(), (mask_name, path)
      np.testing.assert_allclose(value.mean(), 1.0, rtol=1e-6, err_msg=(mask_name, path))
    assert any(np.ptp(v) > 0 for v in flat(mask).values()), f'{mask_name}: learned nothing'


@pytest.mark.parametrize('name', DENSE)
def test_mismatched_trees_are_refused_naming_the_path(name):
  vectors = random_vectors()
  bad = jax.tree_util.tree_map_with_path(
      lambda p, x: jnp.zeros((5, 3)) if tree_lib.path_str(p) == 'out/kernel' else x,
      vectors[1].delta)
  with pytest.raises(ValueError, match='out/kernel'):
    run(name, [vectors[0], vectors[1].replace(delta=bad)], all_vectors=True)
  with pytest.raises(ValueError, match='different regimes'):
    run(name, [vectors[0], vectors[1].replace(regime='linearized')], all_vectors=True)


DATA_FREE = {'averaging': {}, 'task_arithmetic': {},
             'ties': dict(density=0.3, scope='tensor'), 'breadcrumbs': dict(top=0.1, bottom=0.5),
             'consensus': dict(min_tasks=2)}


@pytest.mark.parametrize('name', sorted(DATA_FREE))
def test_data_free_merges_jit(name):
  vectors = random_vectors()
  merge = functools.partial(merging.get(name).merge, **DATA_FREE[name])
  eager, jitted = flat(merge(vectors).delta), flat(jax.jit(merge)(vectors).delta)
  for path in eager:
    np.testing.assert_allclose(jitted[path], eager[path], rtol=1e-6, atol=1e-7, err_msg=path)


def test_dare_and_the_closed_forms_jit():
  vectors = random_vectors()
  key = INPUTS['key']
  jitted = jax.jit(lambda vs, k: dare.merge(vs, key=k, p=0.3))(vectors, key)
  for path, value in flat(dare.merge(vectors, key=key, p=0.3).delta).items():
    np.testing.assert_allclose(flat(jitted.delta)[path], value, rtol=1e-6, err_msg=path)
  fishers = [jax.tree.map(jnp.abs, v.delta) for v in random_vectors(seed=1)]
  eager = flat(fisher.combine(vectors, fishers).delta)
  for path, value in flat(jax.jit(fisher.combine)(vectors, fishers).delta).items():
    np.testing.assert_allclose(value, eager[path], rtol=1e-6, atol=1e-7, err_msg=path)
  grams = [regmean.gram_matrices(APPLY, v.apply_to(THETA0), task_data()['t0'].images, 8)
           for v in vectors]
  combine = functools.partial(regmean.combine, alpha=0.9)
  eager = flat(combine(vectors, THETA0, grams).delta)
  for path, value in flat(jax.jit(combine)(vectors, THETA0, grams).delta).items():
    np.testing.assert_allclose(value, eager[path], rtol=1e-5, atol=1e-6, err_msg=path)


def test_consensus_keeps_entries_that_enough_tall_masks_share():
  deltas = [{'w': jnp.array([1.0, 0.1, 0.0, 2.0])}, {'w': jnp.array([1.0, 0.0, 0.3, -2.0])},
            {'w': jnp.array([0.9, 0.0, 0.0, 0.1])}]
  vectors = [TaskVector(d, (t,), 'full', 'b') for d, t in zip(deltas, TASKS)]
  masks = consensus.tall_masks(vectors, [0.5] * 3)
  # τ_MTL = [2.9, 0.1, 0.3, 0.1]; m_t = |τ_t| ≥ 0.5 |τ_MTL − τ_t|.
  np.testing.assert_array_equal(np.stack([m['w'] for m in masks]),
                                [[True, True, False, True], [True, False, True, True],
                                 [False, False, False, True]])
  merged = consensus.merge(vectors, min_tasks=2, tall_lambda=0.5).delta['w']
  np.testing.assert_allclose(merged, [2.9, 0.0, 0.0, 0.1], rtol=1e-6)
  localized = consensus.task_localized(vectors, [0.5] * 3)
  np.testing.assert_allclose(localized[2].delta['w'], [0.0, 0.0, 0.0, 0.1], rtol=1e-6)


def test_breadcrumbs_drops_both_magnitude_tails_of_every_leaf():
  delta = {'w': jnp.arange(1.0, 21.0) * jnp.array([1, -1] * 10)}
  mask = ops.keep_band(delta, top=0.1, bottom=0.25)['w']
  np.testing.assert_array_equal(np.flatnonzero(mask), np.arange(5, 18))


def test_fisher_takes_each_entry_from_the_tasks_that_depend_on_it():
  # Task t0's inputs only use feature 0, task t1's only feature 1: the hidden layer's kernel
  # row 0 carries Fisher information from t0 alone, row 1 from t1 alone.
  n = 32
  rng = np.random.default_rng(1)
  data = {}
  for i, t in enumerate(TASKS[:2]):
    x = np.zeros((n, 4), np.float32)
    x[:, i] = rng.normal(size=n)
    data[t] = common.TaskData(APPLY, x, rng.integers(0, 3, n).astype(np.int32))
  vectors = random_vectors(tasks=TASKS[:2])
  merged = fisher.merge(vectors, theta0=THETA0, data=data, batch_size=8).delta
  for row, vector in enumerate(vectors):
    np.testing.assert_allclose(merged['hidden']['kernel'][row],
                               vector.delta['hidden']['kernel'][row], rtol=1e-4)


def test_regmean_on_one_linear_layer_is_the_least_squares_merge():
  layer = nn.Dense(3, use_bias=False)
  theta0 = layer.init(jax.random.PRNGKey(0), jnp.zeros((1, 5)))['params']
  apply_fn = lambda params, x: layer.apply({'params': params}, x)
  rng = np.random.default_rng(2)
  inputs = {t: rng.normal(size=(40, 5)).astype(np.float32) * (1 + i)
            for i, t in enumerate(TASKS)}
  vectors = [TaskVector({'kernel': jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}, (t,),
                        'full', 'b') for t in TASKS]
  data = {t: common.TaskData(apply_fn, inputs[t]) for t in TASKS}
  merged = regmean.merge(vectors, theta0=theta0, apply_fn=apply_fn, data=data, alpha=1.0)
  stacked_x = np.concatenate([inputs[t] for t in TASKS]).astype(np.float64)
  stacked_y = np.concatenate([inputs[t] @ (np.asarray(theta0['kernel']) + np.asarray(
      v.delta['kernel'])) for t, v in zip(TASKS, vectors)]).astype(np.float64)
  least_squares = np.linalg.lstsq(stacked_x, stacked_y, rcond=None)[0]
  np.testing.assert_allclose(np.asarray(theta0['kernel']) + merged.delta['kernel'],
                             least_squares, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize('name', ['regmean', 'regmean_plusplus'])
def test_regmean_refuses_linearized_vectors(name):
  with pytest.raises(ValueError, match='linearized'):
    run(name, random_vectors(regime='linearized'))


class Block(nn.Module):
  """x + proj(tanh(fc(x))): a block whose second layer reads its first."""

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(4, name='proj')(jnp.tanh(nn.Dense(4, name='fc')(x)))


class Blocks(nn.Module):
  """Two blocks and a Dense layer after them: RegMean++'s three stages."""

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Block(name=f'blocks_{i}')(x)
    return nn.Dense(3, name='out')(x)


def blocks_problem():
  net = Blocks()
  theta0 = net.init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))['params']
  apply_fn = lambda params, x: net.apply({'params': params}, x)
  vectors = [v.replace(delta=jax.tree.map(lambda d: 3 * d, v.delta)) for v in
             [TaskVector(jax.tree.map(lambda x, k=k: 0.1 * jax.random.normal(k, x.shape),
                                      theta0), (t,), 'full', 'b')
              for t, k in zip(TASKS, jax.random.split(jax.random.PRNGKey(1), 3))]]
  rng = np.random.default_rng(3)
  inputs = {t: rng.normal(size=(30 + 5 * i, 4)).astype(np.float32) * (1 + i)
            for i, t in enumerate(TASKS)}
  data = {t: common.TaskData(apply_fn, inputs[t]) for t in TASKS}
  return theta0, apply_fn, vectors, inputs, data


def numpy_regmean_plusplus(theta0, vectors, inputs, alpha):
  """RegMean++ on `Blocks` in float64 numpy: each block's inputs are the merged blocks'
  outputs on the task's data, and inside the block the task's own layers act."""
  f0 = {p: np.asarray(x, np.float64) for p, x in flat(theta0).items()}
  thetas = [{p: f0[p] + np.asarray(x, np.float64) for p, x in flat(v.delta).items()}
            for v in vectors]
  merged = {p: f0[p] + np.mean([np.asarray(flat(v.delta)[p], np.float64) for v in vectors],
                               axis=0) for p in f0}

  def solve(layer, layer_inputs):
    grams = [x.T @ x for x in layer_inputs]
    grams = [alpha * g + (1 - alpha) * np.diag(np.diag(g)) for g in grams]
    rhs = sum(g @ th[f'{layer}/kernel'] for g, th in zip(grams, thetas))
    return np.linalg.solve(sum(grams), rhs)

  dense = lambda th, layer, x: x @ th[f'{layer}/kernel'] + th[f'{layer}/bias']
  xs = [inputs[t].astype(np.float64) for t in TASKS]
  for i in range(2):
    fc, proj = f'blocks_{i}/fc', f'blocks_{i}/proj'
    merged[f'{fc}/kernel'] = solve(fc, xs)
    merged[f'{proj}/kernel'] = solve(proj, [np.tanh(dense(th, fc, x))
                                            for th, x in zip(thetas, xs)])
    xs = [x + dense(merged, proj, np.tanh(dense(merged, fc, x))) for x in xs]
  merged['out/kernel'] = solve('out', xs)
  return {p: merged[p] - f0[p] for p in f0}, xs


def test_regmean_plusplus_against_numpy():
  """Twice over the same model: the second call finds its compiles cached, and must merge as
  the first did."""
  theta0, apply_fn, vectors, inputs, data = blocks_problem()
  expected, _ = numpy_regmean_plusplus(theta0, vectors, inputs, alpha=0.9)
  for _ in range(2):
    merged = merging.get('regmean_plusplus').merge(vectors, theta0=theta0, apply_fn=apply_fn,
                                                   data=data, alpha=0.9, batch_size=8)
    for path, value in flat(merged.delta).items():
      np.testing.assert_allclose(value, expected[path], rtol=1e-4, atol=1e-5, err_msg=path)


def test_regmean_plusplus_fits_each_layer_to_the_merged_models_own_inputs():
  """Its defining property, against RegMean: the first block sees what RegMean's does, so its
  merge is RegMean's; the last layer's is the least-squares fit, over every task's inputs as
  the merged model makes them, of the tasks' own outputs there, which RegMean's is not."""
  theta0, apply_fn, vectors, inputs, data = blocks_problem()
  plus = flat(merging.get('regmean_plusplus').merge(
      vectors, theta0=theta0, apply_fn=apply_fn, data=data, alpha=1.0, batch_size=8).delta)
  plain = flat(regmean.merge(vectors, theta0=theta0, apply_fn=apply_fn, data=data, alpha=1.0,
                             batch_size=8).delta)
  for layer in ('blocks_0/fc', 'blocks_0/proj'):
    np.testing.assert_allclose(plus[f'{layer}/kernel'], plain[f'{layer}/kernel'], rtol=1e-4,
                               atol=1e-6, err_msg=layer)
  _, merged_inputs = numpy_regmean_plusplus(theta0, vectors, inputs, alpha=1.0)
  w0 = np.asarray(theta0['out']['kernel'], np.float64)
  targets = [x @ (w0 + np.asarray(v.delta['out']['kernel'], np.float64))
             for x, v in zip(merged_inputs, vectors)]
  least_squares = np.linalg.lstsq(np.concatenate(merged_inputs), np.concatenate(targets),
                                  rcond=None)[0]
  np.testing.assert_allclose(w0 + plus['out/kernel'], least_squares, rtol=1e-3, atol=1e-5)
  assert np.abs(w0 + plain['out/kernel'] - least_squares).max() > 1e-2


def toy_adamerging_problem():
  """Task t0's logits are ±c·(1 − (w − 1)²): most confident, lowest entropy, at w = 1."""
  theta0 = {'w': jnp.float32(0.0)}
  vector = TaskVector({'w': jnp.float32(1.0)}, ('t0',), 'full', 'b')

  def logits_fn(params, x):
    s = 3.0 * (1 - (params['w'] - 1) ** 2) * x[:, :1]
    return jnp.concatenate([s, -s], axis=-1)

  x = np.random.default_rng(0).normal(size=(64, 2)).astype(np.float32)
  return theta0, vector, logits_fn, x


def test_adamerging_moves_towards_the_lowest_entropy_and_lowers_it():
  theta0, vector, logits_fn, x = toy_adamerging_problem()
  learned = adamerging.learn([vector], theta0=theta0, data={'t0': common.TaskData(logits_fn, x)},
                             key=jax.random.PRNGKey(0), steps=60, learning_rate=0.05)
  assert abs(float(learned.coefficients[0]) - 1.0) < 0.15
  assert learned.entropies[-1] < 0.75 * learned.entropies[0]


def test_adamerging_reads_no_label():
  theta0, vector, logits_fn, x = toy_adamerging_problem()
  results = []
  for labels in (None, np.full(len(x), -12345, np.int32)):
    learned = adamerging.learn([vector], theta0=theta0,
                               data={'t0': common.TaskData(logits_fn, x, labels)},
                               key=jax.random.PRNGKey(0), steps=5, learning_rate=0.05,
                               granularity='layer')
    results.append(np.asarray(learned.coefficients['w']))
  np.testing.assert_array_equal(results[0], results[1])


def test_unknown_method_is_named():
  with pytest.raises(ValueError, match="unknown merging method 'tie'"):
    merging.get('tie')
