"""NearSwap: θ0's weights, moved to the fine-tuned model's where the two lie within t.

Alchemonaut's algorithm (the BoreanGale-70B model card, 2024), as mergekit's `nearswap`
merges a base a = θ0 and one fine-tuned model b = θ0 + τ_1, entry by entry:

  w = clamp(t / |a − b|, 0, 1)   (1 where a = b),   out = w·b + (1 − w)·a,

so τ_m = w ⊙ τ_1: an entry with |τ_1| ≤ t is taken whole, a larger one shrunk to magnitude t,
sign kept. Applied at λ = 1. mergekit requires t (> 0); the default is the value of the card's
own 70B merge, where about 10% of the weights were swapped whole.
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common


@settings.declare(t=settings.number(1e-3, '(0, inf)', 'the distance from θ0 within which an '
                                    "entry takes the fine-tuned model's value"))
def merge(task_vectors: Sequence[TaskVector], *, t: float) -> TaskVector:
  """τ_m = clamp(t/|τ_1|, 0, 1) ⊙ τ_1 of the one task vector."""
  check_compatible(task_vectors, 'nearswap')
  common.check_one_model(task_vectors, 'nearswap')

  def swapped(delta):
    magnitude = jnp.abs(delta)
    # t/0 is +∞, which mergekit's nan_to_num makes 1: an entry equal in both is kept.
    weight = jnp.where(magnitude > 0, jnp.minimum(t / magnitude, 1.0), 1.0)
    return weight * delta

  return common.merged(task_vectors, jax.tree.map(swapped, task_vectors[0].delta))
