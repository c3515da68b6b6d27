"""Iso-C: the sum of the task vectors with a flat (isotropic) spectrum.

Marczak et al., "No Task Left Behind: Isotropic Model Merging with Common and Task-Specific
Subspaces", ICML 2025. Per matrix layer (`ops.matrices`), with Σ_t τ_t = UΣVᵀ,

  Δ = σ̄ · UVᵀ,   σ̄ = mean of the singular values (every one of the r = min(rows, cols)),

and every other leaf is the mean of the τ_t (FusionBench's iso_utils.py). Applied as θ0 + λ·Δ,
λ chosen on validation on the authors' range 0.1 … 3.0.
"""

from typing import Sequence

import jax.numpy as jnp

from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import svd as svd_lib


def isotropic(u: jnp.ndarray, s: jnp.ndarray, vt: jnp.ndarray) -> jnp.ndarray:
  """U diag(σ̄) Vᵀ: the spectrum s replaced by its mean."""
  return jnp.mean(s) * (u @ vt)


def merge_matrix(matrices: list) -> jnp.ndarray:
  return isotropic(*svd_lib.thin(sum(matrices)))


def merge(task_vectors: Sequence[TaskVector]) -> TaskVector:
  """The Iso-C merge Δ (before λ)."""
  check_compatible(task_vectors, 'iso_c')
  return common.merged(task_vectors, ops.per_matrix(task_vectors, merge_matrix))
