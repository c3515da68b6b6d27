"""Arcee Fusion: the fine-tuned model's entries whose change stands out, the base's elsewhere.

As mergekit's `arcee_fusion` merges a base θ0 and one fine-tuned model θ = θ0 + τ_1, per tensor:
each entry's importance is its change times how far its row's softmax moved,

  s_ij = |τ_ij| · KL(p_i ‖ q_i),   p_i = softmax(θ_i) + ε,   q_i = softmax(θ0_i) + ε,

over each row i of the tensor as PyTorch stores it (a layer's (outputs, inputs) matrix,
`merging.ops.matrices`; a vector is one row), and an entry is taken where s_ij is an upper
outlier of the tensor's importances:

  τ_m = τ_1 ⊙ [s ≥ median + 1.5·(Q3 − Q1)],

(ε = 1e-8), each quantile q the sorted importances' entry at ⌊q·(n − 1)⌋, as mergekit indexes
them. mergekit draws those quantiles from a sample of 10^6 entries (with replacement,
unseeded) where a tensor is larger; here they are the exact ones over every entry, so the
merge is deterministic. Applied at λ = 1; it has no settings.

The importances are computed on the host in numpy, a row's from that row alone, so a streamed
merge scores a tensor a block of whole rows at a time with the same bits (each row's divergence
computed in its first pass and kept), finds the quartiles with the one ranking engine
(`editing.cuts`), as the merge in memory does, and keeps the same entries (`selection`).
"""

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from editing import cuts
from editing import tree as tree_lib
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import sparsity

EPS = np.float32(1e-8)
QUARTILES = (0.25, 0.5, 0.75)


# Each array below is computed in place: a block's temporaries then stay in the cache, which
# halves the time of a row's two softmaxes and logarithm, the same bits.


def _softmax_plus_eps(rows: np.ndarray) -> np.ndarray:
  shifted = rows - rows.max(axis=-1, keepdims=True)
  np.exp(shifted, out=shifted)
  shifted /= shifted.sum(axis=-1, keepdims=True)
  shifted += EPS
  return shifted


def divergence(rows: np.ndarray, base_rows: np.ndarray) -> np.ndarray:
  """KL(p_i ‖ q_i) of each row of the (rows, entries) fine-tuned and base weights, in
  float32."""
  p, q = _softmax_plus_eps(rows), _softmax_plus_eps(base_rows)
  terms = np.log(np.divide(p, q, out=q), out=q)
  terms *= p
  return terms.sum(axis=-1)


def importance(rows: np.ndarray, base_rows: np.ndarray,
               divergences: np.ndarray | None = None) -> np.ndarray:
  """s of each entry of the (rows, entries) fine-tuned and base weights, in float32; with
  `divergences`, their rows' KL(p_i ‖ q_i) found before."""
  if divergences is None:
    divergences = divergence(rows, base_rows)
  scores = np.subtract(rows, base_rows)
  np.abs(scores, out=scores)
  scores *= divergences[:, None]
  return scores


def ranks(n: int) -> list[int]:
  """Which of n importances the quartiles are, as counts of the largest: the entry at
  ⌊q·(n − 1)⌋ of the ascending order is the (n − ⌊q·(n − 1)⌋)-th largest."""
  return [n - int(q * (n - 1)) for q in QUARTILES]


def threshold(quartiles: Sequence[float]) -> np.float32:
  """median + 1.5·IQR of the quartiles (Q1, median, Q3), in float32 as mergekit's tensors."""
  q1, median, q3 = (np.float32(q) for q in quartiles)
  return median + np.float32(1.5) * (q3 - q1)


def block_divergence(theta0: np.ndarray, deltas: Sequence[np.ndarray], row: int) -> np.ndarray:
  """KL(p_i ‖ q_i) of each of a run of whole rows of `row` entries: θ0's and τ_1's entries
  (float32, flat)."""
  base_rows = theta0.reshape(-1, row)
  return divergence(base_rows + deltas[0].reshape(-1, row), base_rows)


def block_importance(theta0: np.ndarray, deltas: Sequence[np.ndarray], row: int,
                     divergences: np.ndarray | None = None) -> np.ndarray:
  """s of a run of whole rows of `row` entries, flat: θ0's and τ_1's entries (float32); with
  `divergences`, the rows' `block_divergence` found before."""
  base_rows = theta0.reshape(-1, row)
  return importance(base_rows + deltas[0].reshape(-1, row), base_rows, divergences).ravel()


def selection(**_) -> sparsity.Scores:
  """What Arcee Fusion keeps of a tensor (`merging.Method.scores`; it has no settings): the
  importances at or above the threshold of their quartiles, each row's divergence computed
  once."""
  return sparsity.Scores(block_importance, ranks=ranks, threshold=threshold, rows=True,
                         per_row=block_divergence)


def merge(task_vectors: Sequence[TaskVector], *, theta0, selected: dict | None = None
          ) -> TaskVector:
  """τ_m = τ_1 ⊙ [s ≥ threshold(s)] of the one task vector, per tensor; `selected`, each
  leaf's mask where found beforehand (a streamed block's, of its whole tensor)."""
  check_compatible(task_vectors, 'arcee_fusion')
  common.check_one_model(task_vectors, 'arcee_fusion')
  if selected is not None:
    return common.merged(task_vectors, tree_lib.map_with_path(
        lambda path, d: jnp.where(selected[path], d, 0.0), task_vectors[0].delta))
  base = tree_lib.flatten(theta0)
  views = ops.matrices(task_vectors[0].delta)

  def fused(path: str, d) -> np.ndarray:
    d = np.asarray(d, np.float32)
    x0 = np.asarray(base[path], np.float32)
    rows = lambda x: np.asarray(ops.rows(views[path], x))
    scores = importance(rows(x0 + d), rows(x0))
    bound = threshold(cuts.largest_values(lambda: [scores.ravel()], np.float32, scores.size,
                                          ranks(scores.size)))
    return np.asarray(ops.from_rows(views[path], np.where(scores >= bound, rows(d), 0.0),
                                    d.shape))

  return common.merged(task_vectors, tree_lib.map_with_path(fused, task_vectors[0].delta))
