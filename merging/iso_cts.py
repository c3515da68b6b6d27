"""Iso-CTS: a common subspace of the tasks' sum plus each task's own directions, isotropic.

Marczak et al., "No Task Left Behind: Isotropic Model Merging with Common and Task-Specific
Subspaces", ICML 2025. Per matrix layer (`ops.matrices`) of rank r = min(rows, cols), with
f = `common_space_fraction`:

  k = ⌊r·f⌋,  s_total = round((r − k)/T)·T,  k = r − s_total,  s = s_total/T;
  U_c Σ_c V_cᵀ = the top k triplets of Σ_t τ_t;
  U_t Σ_t V_tᵀ = the top s triplets of the residual τ_t − U_c U_cᵀ τ_t (projected on the left);
  U = polar([U_1 … U_T U_c]),  Vᵀ = polar([V_1ᵀ; …; V_Tᵀ; V_cᵀ]),
  Δ = σ̄ · U Vᵀ,  σ̄ = the mean of all the kept singular values,

and every other leaf is the mean of the τ_t. As FusionBench's reference: Python's round (half to
even: r = 50, T = 4 gives 2 per task) and the left projection only. Applied as θ0 + λ·Δ, λ chosen
on validation on the authors' range 0.1 … 3.0. Each residual's s ≪ r triplets may be found by
a sketch (`svd='randomized'`, `merging.svd`); the common subspace, k ≈ f·r of the sum's
triplets, is not far enough below r for a sketch to pay and always takes the full SVD.
"""

from typing import Sequence

import jax.numpy as jnp

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import svd as svd_lib


def subspace_sizes(rank: int, tasks: int, fraction: float) -> tuple[int, int]:
  """(k, s): the common subspace's size and each task's."""
  common_size = int(rank * fraction)
  specific = round((rank - common_size) / tasks) * tasks
  return rank - specific, specific // tasks


def merge_matrix(matrices: list, fraction: float, svd: str) -> jnp.ndarray:
  k, s = subspace_sizes(min(matrices[0].shape), len(matrices), fraction)
  u, sigma, vt = svd_lib.thin(sum(matrices))
  u_c, s_c, vt_c = u[:, :k], sigma[:k], vt[:k]
  us, ss, vts = [], [], []
  for w in matrices:
    u_t, s_t, vt_t = svd_lib.top(w - u_c @ (u_c.T @ w), s, svd)
    us.append(u_t)
    ss.append(s_t)
    vts.append(vt_t)
  spectrum = jnp.concatenate(ss + [s_c])
  u_all = ops.polar(jnp.concatenate(us + [u_c], axis=1))
  vt_all = ops.polar(jnp.concatenate(vts + [vt_c], axis=0))
  return jnp.mean(spectrum) * (u_all @ vt_all)


@settings.declare(
    common_space_fraction=settings.number(
        0.8, '(0, 1]', "the share of each layer's rank given to the tasks' common subspace"),
    svd=svd_lib.SETTING)
def merge(task_vectors: Sequence[TaskVector], *, common_space_fraction: float,
          svd: str) -> TaskVector:
  """The Iso-CTS merge Δ (before λ)."""
  check_compatible(task_vectors, 'iso_cts')
  return common.merged(task_vectors, ops.per_matrix(
      task_vectors, lambda ws: merge_matrix(ws, common_space_fraction, svd)))
