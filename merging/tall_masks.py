"""TALL masks: each task's own entries of the multi-task vector.

Wang et al., "Localizing Task Information for Improved Model Merging and Compression",
ICML 2024. With τ_MTL = Σ_t τ_t, task t's model is

  θ0 + m_t ⊙ τ_MTL,   m_t = |τ_t| ≥ λ_t · |τ_MTL − τ_t|,

the entries where task t outweighs the other tasks together (`consensus.tall_masks`, the rule
Consensus merging votes with). One vector per task, each applied to its own task's inputs, at
coefficient 1 as the paper's. λ_t is chosen per task on its own validation split from the
paper's grid {0.2, ..., 0.6} (the merge job chooses each task's setting on its own, for the
methods that keep a vector per task); FusionBench fixes 0.6 for every task.
"""

from typing import Sequence

from editing import settings
from editing.task_vector import TaskVector
from merging import consensus


@settings.declare(
    tall_lambda=settings.number(0.6, '[0, inf)', 'λ_t of the TALL masks (the grid chooses '
                                               'it per task)'))
def merge(task_vectors: Sequence[TaskVector], *, tall_lambda: float) -> list[TaskVector]:
  """Each task's m_t ⊙ τ_MTL, in the order of `task_vectors`."""
  return consensus.task_localized(task_vectors, [tall_lambda] * len(task_vectors))
