"""SCE: select the entries that vary most across the task vectors, calculate each vector's
weight from its energy, erase the minority signs, and merge.

Wan et al., "FuseChat: Knowledge Fusion of Chat Models", 2024, as mergekit's `sce` method
implements it, per tensor:

  select:    keep the ⌊k·n'⌋ entries of largest variance across the T vectors (n' of them have
             a non-zero variance; k = `select_topk`, 1 keeps all),
  calculate: w_t = mean_j τ_t[j]² / Σ_s mean_j τ_s[j]² (1/T where that sum is below 1e-6),
  erase:     a_t[j] = [sgn τ_t[j] = sgn Σ_s τ_s[j]] (a zero sum elects +, a zero entry agrees
             with none),
  τ_m[j] = Σ_t a_t[j] w_t τ_t[j] / max(Σ_t a_t[j] w_t, 1e-6).

Ties in variance go to the earlier entry (mergekit's torch.topk leaves them unspecified).
mergekit gives SCE no per-model weights. λ is chosen on validation.
"""

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import settings
from editing import tree as tree_lib
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops


def merge_leaf(deltas: Sequence[jax.Array], select_topk: float) -> jax.Array:
  """τ_m of one leaf's T deltas."""
  stacked = jnp.stack([jnp.asarray(d, jnp.float32) for d in deltas])
  if select_topk < 1:
    variance = jnp.var(stacked, axis=0).ravel()
    count = jnp.floor(jnp.count_nonzero(variance) * select_topk).astype(jnp.int32)
    if isinstance(count, jax.core.Tracer):
      ranks = jnp.argsort(jnp.argsort(-variance, stable=True))
      selected = ranks < count
    else:  # ranked on the host by `editing.cuts`: the same entries, without two sorts
      selected = tree_lib.top_k(np.asarray(variance), lambda n: int(count), 'tensor')
    stacked = jnp.where(selected.reshape(stacked.shape[1:]), stacked, 0.0)
  energy = jnp.mean(stacked.reshape(len(deltas), -1) ** 2, axis=1)
  total = energy.sum()
  weights = jnp.where(total < 1e-6, 1.0 / len(deltas), energy / jnp.where(total < 1e-6, 1.0,
                                                                            total))
  weights = weights.reshape((-1,) + (1,) * (stacked.ndim - 1))
  agree = (jnp.sign(stacked) == ops.elect_sign([stacked.sum(axis=0)])) & (stacked != 0)
  erased = jnp.where(agree, weights, 0.0)
  return (stacked * erased).sum(axis=0) / jnp.maximum(erased.sum(axis=0), 1e-6)


@settings.declare(
    select_topk=settings.number(1.0, '(0, 1]', 'the share of entries of largest variance '
                                'across the vectors kept, k'))
def merge(task_vectors: Sequence[TaskVector], *, select_topk: float) -> TaskVector:
  """The SCE merge τ_m of the task vectors (before λ)."""
  check_compatible(task_vectors, 'sce')
  return common.merged(task_vectors, jax.tree.map(
      lambda *ds: merge_leaf(ds, select_topk), *[v.delta for v in task_vectors]))
