"""Task arithmetic: τ_m = Σ_t τ_t, applied as θ0 + λ·τ_m.

Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023. The scaling λ is not part of
the merge: it is chosen on validation data (`editing.evaluate.task_addition`).
"""

from typing import Sequence

from editing.task_vector import TaskVector, check_compatible
from merging import common


def merge(task_vectors: Sequence[TaskVector]) -> TaskVector:
  """The sum of the task vectors; they must share regime, base and tree structure."""
  check_compatible(task_vectors, 'task arithmetic')
  return common.merged(task_vectors, sum(task_vectors).delta)
