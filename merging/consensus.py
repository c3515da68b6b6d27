"""TALL masks and Consensus merging: keep what at least `min_tasks` tasks use.

Wang et al., "Localizing Task Information for Improved Model Merging and Compression",
ICML 2024. With the multi-task vector τ_MTL = Σ_t τ_t, task t's TALL mask is

  m_t = |τ_t| ≥ λ_t · |τ_MTL − τ_t|,

the entries where task t dominates the other tasks' sum. `task_localized` rebuilds each task's
own vector m_t ⊙ τ_MTL (compression: it needs the task's identity at inference). Consensus
merging keeps the entries at least k = `min_tasks` tasks use,

  τ_m = τ_MTL ⊙ 1[Σ_t m_t ≥ k],

and is applied as θ0 + λ·τ_m like task arithmetic (k = 2 by default, which drops both the
selfish entries only one task uses and those none does). The paper tunes λ_t per task on
validation; here one λ_t (default 0.5) serves all tasks. With a single vector and k ≥ 2 nothing
is kept: the merge is zero.
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from editing import settings
from editing.errors import UserError
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops


def tall_masks(task_vectors: Sequence[TaskVector], lambdas: Sequence[float]) -> list:
  """m_t = |τ_t| ≥ λ_t |τ_MTL − τ_t| per task."""
  check_compatible(task_vectors, 'tall masks')
  if len(lambdas) != len(task_vectors):
    raise UserError(f'{len(lambdas)} lambdas for {len(task_vectors)} task vectors')
  total = sum(task_vectors).delta
  return [jax.tree.map(lambda d, s, lam=lam: jnp.abs(d) >= lam * jnp.abs(s - d), v.delta, total)
          for v, lam in zip(task_vectors, lambdas)]


def task_localized(task_vectors: Sequence[TaskVector],
                   lambdas: Sequence[float]) -> list[TaskVector]:
  """Each task's m_t ⊙ τ_MTL, to be applied only to that task's inputs."""
  masks = tall_masks(task_vectors, lambdas)
  total = sum(task_vectors).delta
  return [v.replace(delta=ops.where(m, total)) for v, m in zip(task_vectors, masks)]


@settings.declare(
    min_tasks=settings.integer(2, '[1, inf)', 'how many TALL masks must keep an entry, k'),
    tall_lambda=settings.number(0.5, '[0, inf)', 'λ_t of every task\'s TALL mask'))
def merge(task_vectors: Sequence[TaskVector], *, min_tasks: int,
          tall_lambda: float) -> TaskVector:
  """τ_MTL restricted to the entries whose TALL masks agree in at least `min_tasks` tasks."""
  masks = tall_masks(task_vectors, [tall_lambda] * len(task_vectors))
  votes = jax.tree.map(lambda *ms: sum(m.astype(jnp.int32) for m in ms), *masks)
  keep = jax.tree.map(lambda v: v >= min_tasks, votes)
  return common.merged(task_vectors, ops.where(keep, sum(task_vectors).delta))
