"""MagMax: per entry, the task vector entry of the largest magnitude.

Marczak et al., "MagMax: Leveraging Model Merging for Seamless Continual Learning", ECCV 2024:

  τ_m[j] = τ_{t*}[j],   t* = argmax_t |τ_t[j]|   (ties to the later task, as the reference's ≥),

over every leaf, applied as θ0 + λ·τ_m with λ chosen on validation (the authors' script fixes
λ = 0.5, FusionBench's `magmax_merge` 1.0).
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from editing.task_vector import TaskVector, check_compatible
from merging import common


def merge(task_vectors: Sequence[TaskVector]) -> TaskVector:
  """τ_m (before λ)."""
  check_compatible(task_vectors, 'magmax')

  def largest(*deltas):
    out = deltas[0]
    for d in deltas[1:]:
      out = jnp.where(jnp.abs(d) >= jnp.abs(out), d, out)
    return out

  return common.merged(task_vectors, jax.tree.map(largest, *[v.delta for v in task_vectors]))
