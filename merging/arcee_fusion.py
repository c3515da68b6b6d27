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
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from editing import tree as tree_lib
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops

EPS = 1e-8
QUARTILES = (0.25, 0.5, 0.75)


def importance(rows: jax.Array, base_rows: jax.Array) -> jax.Array:
  """s of each entry of the (rows, entries) fine-tuned and base weights."""
  p = jax.nn.softmax(rows, axis=-1) + EPS
  q = jax.nn.softmax(base_rows, axis=-1) + EPS
  divergence = jnp.sum(p * jnp.log(p / q), axis=-1, keepdims=True)
  return jnp.abs(rows - base_rows) * divergence


def threshold(scores: jax.Array) -> jax.Array:
  """median + 1.5·IQR of `scores`, by mergekit's quantile index ⌊q·(n − 1)⌋."""
  ordered = jnp.sort(scores.ravel())
  q1, median, q3 = (ordered[int(q * (ordered.size - 1))] for q in QUARTILES)
  return median + 1.5 * (q3 - q1)


def merge(task_vectors: Sequence[TaskVector], *, theta0) -> TaskVector:
  """τ_m = τ_1 ⊙ [s ≥ threshold(s)] of the one task vector, per tensor."""
  check_compatible(task_vectors, 'arcee_fusion')
  common.check_one_model(task_vectors, 'arcee_fusion')
  base = tree_lib.flatten(theta0)
  views = ops.matrices(task_vectors[0].delta)

  def fused(path: str, d: jax.Array) -> jax.Array:
    d = jnp.asarray(d, jnp.float32)
    x0 = jnp.asarray(base[path], jnp.float32)
    scores = importance(ops.rows(views[path], x0 + d), ops.rows(views[path], x0))
    kept = jnp.where(scores >= threshold(scores), ops.rows(views[path], d), 0.0)
    return ops.from_rows(views[path], kept, d.shape)

  return common.merged(task_vectors, tree_lib.map_with_path(fused, task_vectors[0].delta))
