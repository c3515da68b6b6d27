"""EMR-Merging: one elected task vector, and per task a mask and a rescaler.

Huang et al., "EMR-Merging: Tuning-Free High-Performance Model Merging", NeurIPS 2024. Per
entry, the elected sign and the unified vector are

  γ = sign(Σ_t τ_t) (a zero sum counts as −1, as the authors' code has it),
  τ_uni = γ ⊙ max_t (|τ_t| · 1[τ_t ⊙ γ > 0]),

the largest magnitude among the tasks that agree with γ. Task t keeps the entries where it
agrees, M_t = 1[τ_t ⊙ γ > 0], rescaled so that its mean magnitude is its own:

  ξ_t = Σ_leaves mean|τ_t| / Σ_leaves mean|M_t ⊙ τ_uni|

(a sum of per-leaf means, as the authors' code sums per-tensor means, not one mean over
every entry). Task t's model is θ0 + ξ_t · M_t ⊙ τ_uni: one vector per task, each applied to
its own task's inputs, so the task's identity is needed at inference. No hyperparameters and
no data; stored as τ_uni, T bit-masks and T scalars.
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from editing.task_vector import TaskVector, check_compatible


def merge(task_vectors: Sequence[TaskVector]) -> list[TaskVector]:
  """Each task's ξ_t · M_t ⊙ τ_uni, in the order of `task_vectors`."""
  check_compatible(task_vectors, 'emr')
  deltas = [v.delta for v in task_vectors]
  sign = jax.tree.map(lambda *d: jnp.where(sum(d) > 0, 1.0, -1.0), *deltas)
  unified = jax.tree.map(
      lambda g, *d: g * jnp.max(jnp.stack([jnp.abs(x) * (x * g > 0) for x in d]), axis=0),
      sign, *deltas)
  out = []
  for vector in task_vectors:
    masked = jax.tree.map(lambda d, g, u: u * (d * g > 0), vector.delta, sign, unified)
    own = sum(jnp.mean(jnp.abs(d)) for d in jax.tree.leaves(vector.delta))
    kept = sum(jnp.mean(jnp.abs(m)) for m in jax.tree.leaves(masked))
    rescale = jnp.where(kept > 0, own / jnp.where(kept > 0, kept, 1.0), 0.0)
    out.append(vector.replace(delta=jax.tree.map(lambda m: (rescale * m).astype(m.dtype),
                                                 masked)))
  return out
