"""Weight averaging, the model soup of the fine-tuned models: θ = (1/T) Σ_t θ_t.

Wortsman et al., "Model soups: averaging weights of multiple fine-tuned models improves accuracy
without increasing inference time", ICML 2022. As a task vector, τ_m = (1/T) Σ_t τ_t applied at
λ = 1; it has no hyperparameter (scaling it would make it task arithmetic).
"""

from typing import Sequence

from editing.task_vector import TaskVector, check_compatible
from merging import common


def merge(task_vectors: Sequence[TaskVector]) -> TaskVector:
  """τ_m = mean of the task vectors."""
  check_compatible(task_vectors, 'averaging')
  return common.merged(task_vectors, (1.0 / len(task_vectors) * sum(task_vectors)).delta)
