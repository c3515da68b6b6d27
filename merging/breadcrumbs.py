"""Model Breadcrumbs: drop the largest and the smallest magnitudes of every layer of every task
vector, then task arithmetic.

Davari & Belilovsky, "Model Breadcrumbs: Scaling Multi-Task Model Merging with Sparse Masks",
ECCV 2024:

  τ_m = Σ_t m_t ⊙ τ_t,   m_t keeps, per leaf, the magnitudes between the ⌊bottom·n⌋ smallest
  and the ⌊top·n⌋ largest.

The largest entries are outliers whose sum interferes across tasks; the smallest are noise.
Defaults keep 10% of each leaf after dropping its top 1% (`top=0.01`, `bottom=0.89`); λ is
chosen on validation.
"""

from typing import Any, Sequence

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops


@settings.declare(
    top=settings.number(0.01, '[0, 1)', 'the share of each leaf\'s largest magnitudes dropped'),
    bottom=settings.number(0.89, '[0, 1)', 'the share of its smallest magnitudes dropped'),
    constraint=settings.Constraint(lambda s: s['top'] + s['bottom'] < 1,
                                   'top + bottom must be < 1 (something must be kept)'))
def merge(task_vectors: Sequence[TaskVector], *, top: float, bottom: float,
          keep: Sequence[Any] | None = None) -> TaskVector:
  """Σ_t of each vector with its per-leaf magnitude tails dropped; `keep`, if given, holds the
  band masks already ranked (a streamed merge ranks each tensor on the host first)."""
  check_compatible(task_vectors, 'breadcrumbs')
  if keep is None:
    keep = [ops.keep_band(v.delta, top, bottom) for v in task_vectors]
  return common.merged(task_vectors, sum(
      v.replace(delta=ops.where(k, v.delta)) for k, v in zip(keep, task_vectors)).delta)
