"""LoRA-space merges: PEFT's combinations against peft's own add_weighted_adapter, KnOTS against
a numpy transcription of the paper's steps, LoRM against least squares solved by numpy on each
layer's inputs, and each one's defining property."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import merging
from editing import tree as tree_lib
from editing.errors import UserError
from editing.lora import LowRank
from editing.task_vector import TaskVector
from merging import common
from merging import knots
from merging import lorm
from merging import ops
from merging import peft_combinations
from tests import test_merging as toy

# Two adapted Linear layers of 6 inputs and 5 outputs, kernels (in, out) = (6, 5).
MODULES = ('q', 'v')
INPUTS, OUTPUTS, RANK, ALPHA = 6, 5, 4, 8.0
WEIGHTS = (0.7, -0.4)


def adapters(seed, count=2, rank=RANK):
  """{module: (A (r, in), B (out, r))} per adapter, B away from zero."""
  rng = np.random.default_rng(seed)
  return [{m: (rng.normal(size=(rank, INPUTS)).astype(np.float32),
               rng.normal(size=(OUTPUTS, rank)).astype(np.float32)) for m in MODULES}
          for _ in range(count)]


def as_vectors(factor_sets, scale=ALPHA / RANK):
  return [TaskVector({m: LowRank(jnp.asarray(b), jnp.asarray(a), jnp.float32(scale),
                                 (INPUTS, OUTPUTS)) for m, (a, b) in factors.items()},
                     (f't{i}',), 'lora', 'base') for i, factors in enumerate(factor_sets)]


def ours(combination, factor_sets, **settings):
  method = merging.get(f'peft_{combination}')
  given = {**merging.check_settings(f'peft_{combination}', {}, 'peft'), **settings}
  return method.merge(as_vectors(factor_sets), key=jax.random.PRNGKey(0), weights=WEIGHTS,
                      **given)


def peft_merge(combination, factor_sets, **kwargs):
  """{module: (A, B, scaling)} of peft's add_weighted_adapter on a torch model with these
  adapters."""
  torch = pytest.importorskip('torch')
  peft = pytest.importorskip('peft')

  class Net(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.q = torch.nn.Linear(INPUTS, OUTPUTS)
      self.v = torch.nn.Linear(INPUTS, OUTPUTS)

  config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(MODULES))
  model = peft.get_peft_model(Net(), config, adapter_name='a0')
  for i in range(1, len(factor_sets)):
    model.add_adapter(f'a{i}', config)
  for i, factors in enumerate(factor_sets):
    for m, (a, b) in factors.items():
      layer = getattr(model.base_model.model, m)
      layer.lora_A[f'a{i}'].weight.data = torch.tensor(a)
      layer.lora_B[f'a{i}'].weight.data = torch.tensor(b)
  model.add_weighted_adapter([f'a{i}' for i in range(len(factor_sets))], list(WEIGHTS),
                             'merged', combination_type=combination, **kwargs)
  out = {}
  for m in MODULES:
    layer = getattr(model.base_model.model, m)
    out[m] = (layer.lora_A['merged'].weight.detach().numpy(),
              layer.lora_B['merged'].weight.detach().numpy(), layer.scaling['merged'])
  return out


def both(combination, seed, settings):
  """(peft's merge, ours) of the same random adapters."""
  factor_sets = adapters(seed)
  return (peft_merge(combination, factor_sets, **settings),
          ours(combination, factor_sets, **settings))


@pytest.mark.parametrize('combination, settings', [
    ('cat', {}), ('linear', {}), ('ties', {'density': 0.5}),
    ('ties', {'density': 0.5, 'majority_sign_method': 'frequency'}),
    ('magnitude_prune', {'density': 0.3}),
    # DARE at density 1 draws nothing, so PEFT's unseeded torch generator does not enter.
    ('dare_linear', {'density': 1.0}), ('dare_ties', {'density': 1.0})])
def test_factor_combinations_equal_peft(combination, settings):
  reference, merged = both(combination, 0, settings)
  for m in MODULES:
    a, b, scaling = reference[m]
    assert scaling == 1.0
    np.testing.assert_allclose(merged.delta[m].a, a, rtol=1e-5, atol=1e-6, err_msg=m)
    np.testing.assert_allclose(merged.delta[m].b, b, rtol=1e-5, atol=1e-6, err_msg=m)
    assert float(merged.delta[m].scale) == 1.0


@pytest.mark.parametrize('combination, settings', [
    ('svd', {}), ('svd', {'svd_rank': 2}), ('ties_svd', {'density': 0.5}),
    ('magnitude_prune_svd', {'density': 0.4}), ('dare_linear_svd', {'density': 1.0})])
def test_svd_combinations_equal_peft_up_to_the_singular_vectors_signs(combination, settings):
  reference, merged = both(combination, 1, settings)
  for m in MODULES:
    a, b, _ = reference[m]
    assert merged.delta[m].rank == a.shape[0]
    np.testing.assert_allclose(merged.delta[m].b @ merged.delta[m].a, b @ a, rtol=1e-4,
                               atol=1e-5, err_msg=m)


def test_cat_is_exactly_the_weighted_sum_and_svd_its_best_low_rank_cut():
  factor_sets = adapters(2)
  expected = {m: sum(w * (ALPHA / RANK) * f[m][1] @ f[m][0] for w, f in zip(WEIGHTS, factor_sets))
              for m in MODULES}
  cat = ours('cat', factor_sets)
  svd = ours('svd', factor_sets, svd_rank=3)
  for m in MODULES:
    assert cat.delta[m].rank == 2 * RANK
    np.testing.assert_allclose(cat.delta[m].b @ cat.delta[m].a, expected[m], rtol=1e-5,
                               atol=1e-5)
    # Eckart–Young: the rank-3 error is the norm of the dropped singular values.
    s = np.linalg.svd(expected[m], compute_uv=False)
    error = np.linalg.norm(svd.delta[m].b @ svd.delta[m].a - expected[m])
    np.testing.assert_allclose(error, np.linalg.norm(s[3:]), rtol=1e-4)


def test_svd_clamp_bounds_both_factors_at_the_quantile():
  merged = ours('svd', adapters(3), svd_clamp=0.9)
  unclamped = ours('svd', adapters(3))
  for m in MODULES:
    u, vt = unclamped.delta[m].b, unclamped.delta[m].a
    high = np.quantile(np.concatenate([np.ravel(u), np.ravel(vt)]), 0.9)
    np.testing.assert_allclose(merged.delta[m].b, np.clip(u, -high, high), rtol=1e-6)
    np.testing.assert_allclose(merged.delta[m].a, np.clip(vt, -high, high), rtol=1e-6)


def test_dare_keeps_each_entry_scaled_by_one_over_density_or_drops_it():
  factor_sets = adapters(4, count=1)
  vector = as_vectors(factor_sets)[0]
  merged = merging.get('peft_dare_linear').merge(
      [vector], key=jax.random.PRNGKey(3), weights=[1.0], density=0.5,
      **{k: v for k, v in merging.check_settings('peft_dare_linear', {}, 'peft').items()
         if k != 'density'})
  root = np.sqrt(ALPHA / RANK)
  for m in MODULES:
    a, b = factor_sets[0][m]
    for got, original in ((merged.delta[m].a, root * a), (merged.delta[m].b, root * b)):
      got = np.asarray(got)
      kept = got != 0
      assert 0.2 < kept.mean() < 0.8
      np.testing.assert_allclose(got[kept], original[kept] / 0.5, rtol=1e-6)


def test_factor_combinations_refuse_unequal_ranks_naming_the_kernel():
  mixed = as_vectors(adapters(5, count=1)) + as_vectors(adapters(6, count=1, rank=2))
  with pytest.raises(UserError, match=r"peft_linear: q has adapters of ranks \[2, 4\]"):
    merging.get('peft_linear').merge(mixed, key=jax.random.PRNGKey(0), density=0.2,
                                     majority_sign_method='total', svd_rank=None,
                                     svd_clamp=None)
  cat = merging.get('peft_cat').merge(mixed, key=jax.random.PRNGKey(0), density=0.2,
                                      majority_sign_method='total', svd_rank=None,
                                      svd_clamp=None)
  assert cat.delta['q'].rank == 6


def knots_reference(factor_sets, density=None, dropped=None):
  """The paper's steps in numpy: joint SVD per kernel, TIES over all kernels per task (or the
  given DARE-dropped representations with no trim), majority sign with the global one for
  zero sums, disjoint mean, U times the merge. Returns {module: dense ΔW (out, in)}."""
  scale = ALPHA / RANK
  basis, reps = {}, [[] for _ in factor_sets]
  for m in MODULES:
    x = np.concatenate([scale * f[m][1].astype(np.float64) @ f[m][0] for f in factor_sets],
                       axis=1)
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    k = s > 1e-5
    basis[m] = u[:, k]
    for t, block in enumerate(np.split(s[k, None] * vt[k], len(factor_sets), axis=1)):
      reps[t].append(block)
  flat = [np.concatenate([r.ravel() for r in rep]) for rep in reps]
  if dropped is not None:
    flat = dropped
  else:
    kept = max(1, int(density * flat[0].size))
    flat = [np.where(np.isin(np.arange(f.size), np.argsort(-np.abs(f), kind='stable')[:kept]),
                     f, 0.0) for f in flat]
  total = sum(flat)
  sign = np.where(total > 0, 1.0, np.where(total < 0, -1.0, 1.0 if total.sum() >= 0 else -1.0))
  agree = [(np.sign(f) == sign) & (f != 0) for f in flat]
  merged = sum(np.where(a, f, 0) for a, f in zip(agree, flat)) / np.maximum(sum(agree), 1)
  out, start = {}, 0
  for m in MODULES:
    size = basis[m].shape[1] * INPUTS
    out[m] = basis[m] @ merged[start:start + size].reshape(basis[m].shape[1], INPUTS)
    start += size
  return out


def test_knots_ties_equals_the_numpy_transcription():
  factor_sets = adapters(7, count=3)
  merged = knots.merge_ties(as_vectors(factor_sets), density=0.3)
  reference = knots_reference(factor_sets, density=0.3)
  for m in MODULES:
    np.testing.assert_allclose(merged.delta[m].scale * merged.delta[m].b @ merged.delta[m].a,
                               reference[m], rtol=1e-4, atol=1e-5, err_msg=m)


def test_knots_dare_equals_the_transcription_on_the_same_draws():
  factor_sets = adapters(8, count=3)
  vectors = as_vectors(factor_sets)
  key = jax.random.PRNGKey(5)
  merged = knots.merge_dare(vectors, key=key, p=0.3)
  _, reps = knots.aligned(vectors)
  dropped = [ops.drop_and_rescale(r, 0.3, k) for r, k in zip(reps, jax.random.split(key, 3))]
  flat = [np.concatenate([np.ravel(d[m]) for m in MODULES]) for d in dropped]
  zeros = np.mean([np.mean(f == 0) for f in flat])
  assert 0.15 < zeros < 0.45  # p = 0.3 of the entries dropped
  reference = knots_reference(factor_sets, dropped=flat)
  for m in MODULES:
    np.testing.assert_allclose(merged.delta[m].b @ merged.delta[m].a, reference[m], rtol=1e-4,
                               atol=1e-5, err_msg=m)


def test_knots_shared_basis_reconstructs_every_task_and_one_task_merges_to_itself():
  factor_sets = adapters(9, count=3)
  vectors = as_vectors(factor_sets)
  basis, reps = knots.aligned(vectors)
  for t, factors in enumerate(factor_sets):
    for m in MODULES:
      np.testing.assert_allclose(basis[m] @ reps[t][m],
                                 (ALPHA / RANK) * factors[m][1] @ factors[m][0], rtol=1e-4,
                                 atol=1e-5)
  alone = knots.merge_ties(vectors[:1], density=1.0)
  for m in MODULES:
    np.testing.assert_allclose(alone.delta[m].b @ alone.delta[m].a,
                               (ALPHA / RANK) * factor_sets[0][m][1] @ factor_sets[0][m][0],
                               rtol=1e-4, atol=1e-5)


def test_lora_space_merges_refuse_dense_vectors():
  dense = TaskVector({'q': jnp.ones((INPUTS, OUTPUTS))}, ('t',), 'full', 'base')
  with pytest.raises(UserError, match='knots_ties merges LoRA task vectors'):
    knots.merge_ties([dense, dense], density=0.2)
  with pytest.raises(UserError, match='peft_cat combines LoRA adapters'):
    peft_combinations.merge([dense], combination='cat', key=jax.random.PRNGKey(0),
                            density=0.2, majority_sign_method='total', svd_rank=None,
                            svd_clamp=None)


def lorm_problem(seed, tasks=3, inputs=6, outputs=5, rank=2, examples=9):
  rng = np.random.default_rng(seed)
  xs = [rng.normal(size=(examples, inputs)) for _ in range(tasks)]
  deltas = [rng.normal(size=(outputs, rank)) @ rng.normal(size=(rank, inputs))
            for _ in range(tasks)]
  return xs, deltas, [x.T @ x for x in xs]


def test_lorm_solves_are_the_least_squares_optimum_of_their_factor():
  """Each solve against numpy's lstsq on the stacked inputs: min Σ_t ‖(ΔW_t − B A) X_tᵀ‖²."""
  xs, deltas, grams = lorm_problem(0)
  m, g = sum(d @ gt for d, gt in zip(deltas, grams)), sum(grams)
  rng = np.random.default_rng(1)
  a = rng.normal(size=(2, 6))
  targets = np.concatenate([d @ x.T for d, x in zip(deltas, xs)], axis=1)  # (out, Σ n)
  inputs = np.concatenate([a @ x.T for x in xs], axis=1)  # (r, Σ n)
  expected_b = np.linalg.lstsq(inputs.T, targets.T, rcond=None)[0].T
  np.testing.assert_allclose(lorm.solve_b(m, g, a), expected_b, rtol=1e-8, atol=1e-10)
  b = rng.normal(size=(5, 2))
  # vec(B A Xᵀ) = (X ⊗ B) vec(A), vectors in column-major order.
  design = np.concatenate([np.kron(x, b) for x in xs])
  rhs = np.concatenate([(d @ x.T).ravel(order='F') for d, x in zip(deltas, xs)])
  expected_a = np.linalg.lstsq(design, rhs, rcond=None)[0].reshape((2, 6), order='F')
  np.testing.assert_allclose(lorm.solve_a(m, g, b), expected_a, rtol=1e-7, atol=1e-9)
  # Optimal in its factor: no perturbation of B does better.
  best = lorm.loss(deltas, grams, expected_b, a)
  for _ in range(5):
    assert lorm.loss(deltas, grams, expected_b + 1e-3 * rng.normal(size=(5, 2)), a) > best


def test_lorm_alternation_never_raises_the_loss_and_recovers_a_shared_adapter():
  xs, deltas, grams = lorm_problem(2)
  previous = np.inf
  for rounds in range(1, 6):
    b, a = lorm.fit(deltas, grams, 2, rounds)
    current = lorm.loss(deltas, grams, b, a)
    assert current <= previous * (1 + 1e-9)
    previous = current
  # Tasks that all hold one rank-2 delta merge to that delta exactly.
  same = [deltas[0]] * 3
  b, a = lorm.fit(same, grams, 2, 3)
  np.testing.assert_allclose(b @ a, deltas[0], rtol=1e-7, atol=1e-9)


LOW_RANK = sorted(n for n, m in merging.REGISTRY.items() if m.low_rank and n != 'lorm')


def merge_with_defaults(name, vectors, **settings):
  method = merging.get(name)
  extra = {'key': jax.random.PRNGKey(0)} if 'key' in method.reads else {}
  given = {**merging.check_settings(name, {}, name), **settings}
  return method.merge(vectors, **extra, **given)


@pytest.mark.parametrize('name', LOW_RANK)
def test_lora_space_merges_keep_provenance_and_factors(name):
  vectors = as_vectors(adapters(11, count=3))
  merged = merge_with_defaults(name, vectors)
  assert merged.low_rank and merged.tasks == ('t0', 't1', 't2') and merged.regime == 'lora'
  assert merged.delta.keys() == vectors[0].delta.keys()
  assert all(f.shape == (INPUTS, OUTPUTS) for f in merged.delta.values())
  with pytest.raises(UserError, match='different regimes'):
    merge_with_defaults(name, [vectors[0], vectors[1].replace(regime='l_lora')])


@pytest.mark.parametrize('name, settings', [
    ('peft_cat', {}), ('peft_linear', {}), ('peft_svd', {}), ('peft_ties_svd', {'density': 1.0}),
    ('knots_ties', {'density': 1.0}), ('knots_dare', {'p': 0.0})])
def test_one_adapter_merges_to_itself(name, settings):
  factor_sets = adapters(12, count=1)
  merged = merge_with_defaults(name, as_vectors(factor_sets), **settings)
  for m in MODULES:
    a, b = factor_sets[0][m]
    np.testing.assert_allclose(merged.delta[m].scale * merged.delta[m].b @ merged.delta[m].a,
                               (ALPHA / RANK) * b @ a, rtol=1e-4, atol=1e-5, err_msg=m)


def test_lorm_merge_equals_alternating_least_squares_on_each_layers_inputs():
  """The whole merge on a two-layer net: each task's inputs to each layer taken by hand on its
  own fine-tuned model, then the B and A steps solved by numpy's lstsq on them."""
  rng = np.random.default_rng(13)
  kernels = {'hidden/kernel': (4, 6), 'out/kernel': (6, 3)}
  vectors = [TaskVector({p: LowRank(0.3 * rng.normal(size=(o, 2)).astype(np.float32),
                                    rng.normal(size=(2, i)).astype(np.float32),
                                    np.float32(1.5), (i, o)) for p, (i, o) in kernels.items()},
                        (t,), 'lora', 'base') for t in toy.TASKS]
  data = {t: common.TaskData(toy.APPLY, rng.normal(size=(20, 4)).astype(np.float32))
          for t in toy.TASKS}
  merged = lorm.merge(vectors, theta0=toy.THETA0, apply_fn=toy.APPLY, data=data, rounds=3,
                      alpha=1.0, batch_size=8)
  inputs = {p: [] for p in kernels}
  for v, t in zip(vectors, toy.TASKS):
    params = tree_lib.flatten(v.apply_to(toy.THETA0))
    x = data[t].images.astype(np.float64)
    inputs['hidden/kernel'].append(x)
    inputs['out/kernel'].append(np.tanh(x @ params['hidden/kernel'] + params['hidden/bias']))
  for path in kernels:
    deltas = [np.asarray(v.delta[path].scale * v.delta[path].b @ v.delta[path].a, np.float64)
              for v in vectors]
    xs = inputs[path]
    u, s, vt = np.linalg.svd(sum(deltas), full_matrices=False)
    b, a = u[:, :2] * s[:2], vt[:2]
    targets = np.concatenate([d @ x.T for d, x in zip(deltas, xs)], axis=1)
    for _ in range(3):
      b = np.linalg.lstsq(np.concatenate([a @ x.T for x in xs], axis=1).T, targets.T,
                          rcond=None)[0].T
      design = np.concatenate([np.kron(x, b) for x in xs])
      a = np.linalg.lstsq(design, np.concatenate([(d @ x.T).ravel(order='F')
                                                  for d, x in zip(deltas, xs)]),
                          rcond=None)[0].reshape(a.shape, order='F')
    np.testing.assert_allclose(merged.delta[path].b @ merged.delta[path].a, b @ a, rtol=1e-3,
                               atol=1e-4, err_msg=path)
