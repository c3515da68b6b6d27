"""Task negation: a fine-tuned model's task vector subtracted from the base, to forget its task.

Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023:

  θ = θ0 − λ·τ_1,   as a merge τ_m = −τ_1 applied as θ0 + λ·τ_m.

λ is chosen as the negation protocol chooses it (`editing.evaluate`): the lowest target
accuracy whose control accuracy stays at least 95% of the base's.
"""

from typing import Sequence

import jax

from editing.task_vector import TaskVector, check_compatible
from merging import common


def merge(task_vectors: Sequence[TaskVector]) -> TaskVector:
  """τ_m = −τ_1 of the one task vector."""
  check_compatible(task_vectors, 'negation')
  common.check_one_model(task_vectors, 'negation')
  return common.merged(task_vectors, jax.tree.map(lambda d: -d, task_vectors[0].delta))
