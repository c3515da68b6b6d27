"""TSV-M: Task Singular Vectors merging, each task's top singular triplets in a whitened frame.

Gargiulo et al., "Task Singular Vectors: Reducing Task Interference in Model Merging",
CVPR 2025. Per matrix layer (`ops.matrices`), with τ_t = U_t Σ_t V_tᵀ, r = min(rows, cols) and
k = ⌊r/T⌋ components per task,

  Û = [U_1[:, :k] … U_T[:, :k]],   ŝ = [σ_1[:k] … σ_T[:k]],   V̂ = [V_1[:, :k] … V_T[:, :k]],
  Δ = polar(Û) diag(ŝ) polar(V̂)ᵀ,   polar(A) = PQᵀ for A = PΣQᵀ,

and every other leaf is the mean of the τ_t, as FusionBench's reference (TSVM_utils.py) and the
authors' code do (the spare r − T·k slots stay empty). Applied as θ0 + λ·Δ, λ chosen on
validation on the authors' range 0.1 … 3.0. Only the top k = r/T triplets of each τ_t are
read: `svd='randomized'` finds them by a sketch (`merging.svd`) instead of the full SVD.
"""

from typing import Sequence

import jax.numpy as jnp

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import svd as svd_lib


def merge_matrix(matrices: list, svd: str) -> jnp.ndarray:
  """Δ of one layer from the task matrices."""
  k = min(matrices[0].shape) // len(matrices)
  svds = [svd_lib.top(w, k, svd) for w in matrices]
  u = jnp.concatenate([u for u, _, _ in svds], axis=1)
  s = jnp.concatenate([s for _, s, _ in svds])
  v = jnp.concatenate([vt.T for _, _, vt in svds], axis=1)
  return ops.polar(u) @ jnp.diag(s) @ ops.polar(v).T


@settings.declare(svd=svd_lib.SETTING)
def merge(task_vectors: Sequence[TaskVector], *, svd: str) -> TaskVector:
  """The TSV-M merge Δ (before λ)."""
  check_compatible(task_vectors, 'tsv_m')
  return common.merged(task_vectors, ops.per_matrix(
      task_vectors, lambda ws: merge_matrix(ws, svd)))
