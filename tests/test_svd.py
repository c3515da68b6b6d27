"""The randomized truncated SVD against numpy's exact one, and the merges that may use it against
their full-SVD selves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import merging
from editing import tree as tree_lib
from editing.errors import UserError
from editing.lora import LowRank
from editing.task_vector import TaskVector
from merging import continual
from merging import svd


def with_spectrum(rows, cols, sigma, seed=0):
  """U diag(σ) Vᵀ with Haar-random orthonormal U and V: a matrix whose spectrum is σ."""
  rng = np.random.default_rng(seed)
  r = len(sigma)
  u = np.linalg.qr(rng.normal(size=(rows, r)))[0]
  v = np.linalg.qr(rng.normal(size=(cols, r)))[0]
  return ((u * sigma) @ v.T).astype(np.float32)


def aligned(a, b):
  """a's columns with the signs of b's: singular vectors are defined up to sign."""
  return a * np.sign(np.sum(a * b, axis=0, keepdims=True))


# σ_i = 1/i decays as slowly as a fine-tuned layer's head of spectrum does. Halko et al.'s bound
# puts the sketch's error near (σ_{l+1}/σ_k)^{2q+1} relative to σ_k: with k = 16, l = 26 and
# q = 2 the top σ agree to a few parts in a thousand and the rank-k error is within 0.1% of
# the best; 1% and 0.5% leave room for the draw.
@pytest.mark.parametrize('shape', [(256, 192), (192, 256)])
@pytest.mark.parametrize('seed', [0, 1])
def test_top_singular_finds_the_top_of_a_decaying_spectrum(shape, seed):
  k = 16
  sigma = 1.0 / np.arange(1, min(shape) + 1)
  a = with_spectrum(*shape, sigma, seed=seed)
  u, s, vt = (np.asarray(x) for x in svd.top_singular(jnp.asarray(a), k, seed=seed))
  assert (u.shape, s.shape, vt.shape) == ((shape[0], k), (k,), (k, shape[1]))
  s_exact = np.linalg.svd(a.astype(np.float64), compute_uv=False)
  np.testing.assert_allclose(s, s_exact[:k], rtol=1e-2)
  np.testing.assert_allclose(u.T @ u, np.eye(k), atol=1e-5)
  np.testing.assert_allclose(vt @ vt.T, np.eye(k), atol=1e-5)
  eckart_young = np.sqrt(np.sum(s_exact[k:] ** 2))
  assert np.linalg.norm(a - (u * s) @ vt) <= (1 + 5e-3) * eckart_young


def test_power_iterations_close_in_on_the_best_rank_k_error():
  a = with_spectrum(256, 192, 1.0 / np.arange(1, 193) ** 0.5)
  best = np.sqrt(np.sum(np.linalg.svd(a.astype(np.float64), compute_uv=False)[16:] ** 2))
  errors = [np.linalg.norm(a - np.asarray((u * s) @ vt)) / best
            for u, s, vt in (svd.top_singular(jnp.asarray(a), 16, power_iterations=q)
                             for q in (0, 1, 2))]
  assert errors[0] > errors[1] > errors[2] >= 1 - 1e-6


def test_a_seed_gives_the_same_triplets_every_time():
  a = jnp.asarray(with_spectrum(128, 96, 1.0 / np.arange(1, 97)))
  first, again = svd.top_singular(a, 8, seed=3), svd.top_singular(a, 8, seed=3)
  for x, y in zip(first, again):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert not np.array_equal(np.asarray(first[0]), np.asarray(svd.top_singular(a, 8, seed=4)[0]))


@pytest.mark.parametrize('shape, k', [((40, 30), 25), ((30, 40), 20), ((12, 50), 12)])
def test_a_sketch_as_wide_as_the_matrix_falls_back_to_numpys_truncated_svd(shape, k):
  """k + oversample ≥ min(m, n): the exact SVD, cut to k."""
  a = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  u, s, vt = (np.asarray(x) for x in svd.top_singular(jnp.asarray(a), k))
  u_np, s_np, vt_np = np.linalg.svd(a, full_matrices=False)
  np.testing.assert_allclose(s, s_np[:k], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(aligned(u, u_np[:, :k]), u_np[:, :k], atol=1e-4)
  np.testing.assert_allclose(aligned(vt.T, vt_np[:k].T), vt_np[:k].T, atol=1e-4)


def test_full_is_the_exact_svd_cut_to_k():
  a = with_spectrum(64, 48, 1.0 / np.arange(1, 49))
  u, s, vt = (np.asarray(x) for x in svd.top(jnp.asarray(a), 5, 'full'))
  u_np, s_np, vt_np = np.linalg.svd(a, full_matrices=False)
  np.testing.assert_allclose(s, s_np[:5], rtol=1e-5)
  np.testing.assert_allclose((u * s) @ vt, (u_np[:, :5] * s_np[:5]) @ vt_np[:5], atol=1e-5)


def structured_vectors(common, specific, count=4, seed=0):
  """Task vectors τ_t = C + S_t + N on a (128 outputs × 96 inputs) kernel: a shared C of rank
  `common` (σ from 10 to 5), each task's own S_t of rank `specific` (σ from 1 to 0.5) in
  directions orthogonal to C's and to the other tasks', and a noise floor N of σ ≈ 1e-4; a bias
  beside it, which every method averages."""
  rng = np.random.default_rng(seed)
  rows, cols = 128, 96
  u = np.linalg.qr(rng.normal(size=(rows, cols)))[0]
  v = np.linalg.qr(rng.normal(size=(cols, cols)))[0]
  def block(start, rank, top):
    sigma = np.linspace(top, top / 2, rank)
    return (u[:, start:start + rank] * sigma) @ v[:, start:start + rank].T
  shared = block(0, common, 10.0)
  out = []
  for t in range(count):
    noise = 1e-4 * rng.normal(size=(rows, cols)) / np.sqrt(rows)
    matrix = shared + block(common + t * specific, specific, 1.0) + noise
    flat = {'blocks_0/mlp_fc/kernel': matrix.T.astype(np.float32),
            'blocks_0/mlp_fc/bias': rng.normal(size=rows).astype(np.float32)}
    out.append(TaskVector(tree_lib.unflatten(flat), (f'task{t}',), 'full', 'base'))
  return out


# Each method's cut falls at a gap of its matrices' spectra, where its merge is well defined:
# TSV-M keeps k = 96/4 = 24 of each τ_t = S_t, of rank 24 (with C, or with k above the rank,
# TSV-M's whitening would mix in the noise floor's arbitrary directions, full SVD or not); CART
# keeps k = 24 of each centred τ_t − τ̄, of rank 4·6 (C cancels); Iso-CTS's common subspace is
# C's 76 directions and each residual's s = 5 are S_t's. The sketch (l = k + 10 columns, 2
# power iterations) then misses a kept direction by about (σ_{l+1}/σ_k)^5 ≈ (1e-4/0.5)^5,
# nothing; what is left is float32's rounding and the noise floor, 1e-4 of σ_k: a relative
# error of 1e-3 per leaf holds with a wide margin (the errors are near 1e-6), and a sketch that
# lost a kept direction would be off by over 1e-2.
@pytest.mark.parametrize('name, common, specific, given', [
    ('tsv_m', 0, 24, {}), ('cart', 8, 6, {'rank_ratio': 0.25}), ('iso_cts', 76, 5, {})])
def test_a_randomized_merge_is_close_to_the_full_one(name, common, specific, given):
  vectors = structured_vectors(common, specific)
  method = merging.get(name)
  assert method.settings['svd'].default == 'full'
  full = tree_lib.flatten(method.merge(vectors, svd='full', **given).delta)
  randomized = tree_lib.flatten(method.merge(vectors, svd='randomized', **given).delta)
  for path, expected in full.items():
    expected, got = np.asarray(expected), np.asarray(randomized[path])
    assert np.linalg.norm(got - expected) <= 1e-3 * np.linalg.norm(expected), path


def test_an_unknown_solver_is_refused_by_name():
  with pytest.raises(UserError, match=r"config.tsv_m.svd = 'lanczos': must be one of"):
    merging.check_settings('tsv_m', {'svd': 'lanczos'}, 'config.tsv_m')


def test_an_svd_that_does_not_converge_is_taken_again_by_the_qr_algorithm(monkeypatch):
  """`svd.thin` returns the default SVD where it is finite, and where it is not (LAPACK's
  gesdd failing to converge, made to fail here) the QR algorithm's: numpy's singular values,
  and factors that rebuild the matrix."""
  a = jnp.asarray(with_spectrum(12, 7, np.geomspace(2.0, 1e-5, 7)), jnp.float32)
  for got, want in zip(svd.thin(a), jnp.linalg.svd(a, full_matrices=False)):
    np.testing.assert_array_equal(got, want)
  failing = lambda m, full_matrices: tuple(jnp.full_like(x, jnp.nan) for x in
                                           jax.lax.linalg.svd(m, full_matrices=full_matrices))
  monkeypatch.setattr(jnp.linalg, 'svd', failing)
  u, s, vt = svd.thin(a)
  np.testing.assert_allclose(s, np.linalg.svd(np.asarray(a, np.float64), compute_uv=False),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(u @ jnp.diag(s) @ vt, a, atol=1e-5)


def test_opcm_and_peft_svd_combinations_take_a_failing_svd_again(monkeypatch):
  """OPCM's projection (a complete SVD) and PEFT's svd combination (a thin one) read
  `merging.svd`: with the default SVD made to fail, each gives what it gave before."""
  rng = np.random.default_rng(3)
  merged = jnp.asarray(with_spectrum(9, 6, np.geomspace(3.0, 1e-4, 6)), jnp.float32)
  arriving = jnp.asarray(rng.normal(size=(9, 6)), jnp.float32)
  lora_vectors = [TaskVector(
      {'layer/kernel': LowRank(jnp.asarray(rng.normal(size=(6, 2)), jnp.float32),
                               jnp.asarray(rng.normal(size=(2, 5)), jnp.float32),
                               jnp.float32(1.0), (5, 6))}, (f't{k}',), 'lora', 'base')
                  for k in range(2)]
  peft_svd = lambda: merging.get('peft_svd').merge(
      lora_vectors, key=jax.random.PRNGKey(0),
      **merging.check_settings('peft_svd', {}, 'peft')).delta
  projected, combined = continual.project_out(merged, arriving, 0.5), peft_svd()
  failing = lambda m, full_matrices: tuple(jnp.full_like(x, jnp.nan) for x in
                                           jax.lax.linalg.svd(m, full_matrices=full_matrices))
  monkeypatch.setattr(jnp.linalg, 'svd', failing)
  np.testing.assert_allclose(continual.project_out(merged, arriving, 0.5), projected,
                             rtol=1e-4, atol=1e-4)
  for path, low_rank in peft_svd().items():
    np.testing.assert_allclose(low_rank.matrix(), combined[path].matrix(), atol=1e-4)
