"""Extraction: a fine-tuned model's task vector itself, τ_1 = θ_1 − θ0.

Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023. As a merge, τ_m = τ_1 applied
at λ = 1 gives back the fine-tuned model; a checkpoint merge writes τ_1 itself, in float32
(`Method.writes`), for a later addition to any model of the same base.
"""

from typing import Sequence

from editing.task_vector import TaskVector, check_compatible
from merging import common


def merge(task_vectors: Sequence[TaskVector]) -> TaskVector:
  """τ_m = τ_1 of the one task vector."""
  check_compatible(task_vectors, 'extract')
  common.check_one_model(task_vectors, 'extract')
  return common.merged(task_vectors, task_vectors[0].delta)
