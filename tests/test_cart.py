"""CART against a plain numpy port of its formula, and its defining properties."""

import numpy as np
import pytest

import merging
from editing import tree as tree_lib
from editing.task_vector import TaskVector

# A ViT block's leaves: 3-D attention kernels, an MLP kernel, biases and a norm.
SHAPES = {'blocks_0/attn/query/kernel': (12, 2, 6), 'blocks_0/attn/query/bias': (2, 6),
          'blocks_0/attn/out/kernel': (2, 6, 12), 'blocks_0/mlp_fc/kernel': (12, 20),
          'blocks_0/mlp_fc/bias': (20,), 'blocks_0/ln_1/scale': (12,), 'embed/kernel': (12, 8)}
# How each matrix leaf reads as (outputs, inputs): a flax kernel flattened, then transposed.
MATRIX = {'blocks_0/attn/query/kernel': (12, 12), 'blocks_0/attn/out/kernel': (12, 12),
          'blocks_0/mlp_fc/kernel': (12, 20)}


def vectors(count=4, seed=0):
  rng = np.random.default_rng(seed)
  return [TaskVector(tree_lib.unflatten({p: rng.normal(size=s).astype(np.float32)
                                         for p, s in SHAPES.items()}), (f't{i}',), 'full', 'b')
          for i in range(count)]


def numpy_cart(taus, rank_ratio, prior):
  """τ̄ + λ Σ_t SVD_k(τ_t − τ̄) on the attention and MLP matrices, τ̄ elsewhere."""
  out = {}
  for path in SHAPES:
    leaves = np.stack([tree_lib.flatten(t.delta)[path].astype(np.float64) for t in taus])
    mean = leaves.mean(0)
    if path not in MATRIX:
      out[path] = mean
      continue
    inputs, outputs = MATRIX[path]
    k = int(rank_ratio * min(inputs, outputs))
    moved = np.zeros((outputs, inputs))
    for x in leaves:
      u, s, vt = np.linalg.svd((x - mean).reshape(inputs, outputs).T, full_matrices=False)
      moved += u[:, :k] @ np.diag(s[:k]) @ vt[:k]
    out[path] = mean + prior * moved.T.reshape(mean.shape)
  return out


# Ranks k = 1 and 3 of these 12 × 12 and 12 × 20 matrices: a cut between nearly equal singular
# values would be decided by float32's rounding, not by the formula.
@pytest.mark.parametrize('rank_ratio, prior', [(0.12, 2.0), (0.25, 0.7)])
def test_cart_against_numpy(rank_ratio, prior):
  taus = vectors()
  merged = merging.get('cart').merge(taus, rank_ratio=rank_ratio, prior=prior)
  expected = numpy_cart(taus, rank_ratio, prior)
  for path, x in tree_lib.flatten(merged.delta).items():
    np.testing.assert_allclose(x, expected[path], rtol=1e-4, atol=1e-5, err_msg=path)


def test_only_the_truncated_matrices_leave_the_average_and_each_by_at_most_t_k_ranks():
  taus = vectors(count=3)
  merged = tree_lib.flatten(merging.get('cart').merge(taus, rank_ratio=0.25, prior=1.0).delta)
  mean = {p: np.mean([tree_lib.flatten(t.delta)[p] for t in taus], axis=0) for p in SHAPES}
  for path in SHAPES:
    moved = (merged[path] - mean[path]).astype(np.float64)
    if path not in MATRIX:  # Σ_t (τ_t − τ̄) = 0: biases, norms and other matrices stay at τ̄
      np.testing.assert_allclose(moved, 0, atol=1e-6, err_msg=path)
      continue
    inputs, outputs = MATRIX[path]
    k = int(0.25 * min(inputs, outputs))
    assert np.linalg.matrix_rank(moved.reshape(inputs, outputs), tol=1e-4) <= 3 * k, path
    assert np.abs(moved).max() > 1e-3, path  # the truncation left something to add


def test_full_rank_gives_the_average_back():
  """ρ = 1 keeps each centred vector whole, and the centred vectors sum to zero."""
  taus = vectors()
  merged = tree_lib.flatten(merging.get('cart').merge(taus, rank_ratio=1.0, prior=2.0).delta)
  for path, x in merged.items():
    np.testing.assert_allclose(
        x, np.mean([tree_lib.flatten(t.delta)[path] for t in taus], axis=0), atol=1e-5,
        err_msg=path)
