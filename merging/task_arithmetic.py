"""Task arithmetic: τ_m = Σ_t τ_t, applied as θ0 + λ·τ_m.

Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023. The scaling λ is not part of
the merge: it is chosen on validation data (`editing.evaluate.task_addition`). With per-vector
`weights`, τ_m = Σ_t w_t τ_t, divided by Σ_t w_t if `normalize` (mergekit's linear and
task_arithmetic methods).
"""

from typing import Sequence

import jax

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common


@settings.declare(normalize=settings.flag(False, 'divide the weighted sum by Σ_t w_t'))
def merge(task_vectors: Sequence[TaskVector], *, normalize: bool,
          weights: Sequence[float] | None = None) -> TaskVector:
  """The (weighted) sum of the task vectors; they must share regime, base and tree structure."""
  check_compatible(task_vectors, 'task arithmetic')
  if weights is None:
    total, weight = sum(task_vectors), len(task_vectors)
  else:
    common.check_weights(weights, len(task_vectors), 'task arithmetic')
    total, weight = sum(w * v for w, v in zip(weights, task_vectors)), sum(weights)
  delta = jax.tree.map(lambda d: d / weight, total.delta) if normalize else total.delta
  return common.merged(task_vectors, delta)
