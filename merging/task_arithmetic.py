"""Task arithmetic: τ_m = Σ_t τ_t, applied as θ0 + λ·τ_m.

Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023. The scaling λ is not part of
the merge: the evaluator chooses it on validation data (`editing.evaluate.task_addition`).
"""

from typing import Sequence

from editing.task_vector import TaskVector


def merge(task_vectors: Sequence[TaskVector]) -> TaskVector:
  """The sum of the task vectors; they must share regime, base and tree structure."""
  if not task_vectors:
    raise ValueError('task arithmetic needs at least one task vector')
  return sum(task_vectors[1:], task_vectors[0])
