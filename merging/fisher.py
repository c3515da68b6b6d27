"""Fisher merging: the fine-tuned models averaged entry by entry, weighted by their Fisher
information.

Matena & Raffel, "Merging Models with Fisher-Weighted Averaging", NeurIPS 2022:

  θ_m = Σ_t F_t ⊙ θ_t / Σ_t F_t,   F_t = (1/N) Σ_i (∂ log p(y_i | x_i; θ_t) / ∂θ)²,

the diagonal empirical Fisher of fine-tuned model t on N labeled training examples of its task.
As a task vector (θ_t = θ0 + τ_t) this is τ_m = Σ_t F_t ⊙ τ_t / Σ_t F_t, applied at λ = 1.
Entries no task's output depends on (Σ_t F_t = 0) take the plain mean of the τ_t.
"""

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import gradients
from editing import settings
from editing import tree as tree_lib
from editing.task_vector import TaskVector, check_compatible
from merging import common


def diagonal_fisher(logits_fn: common.LogitsFn, params: common.PyTree, images: np.ndarray,
                    labels: np.ndarray, batch_size: int = 32) -> common.PyTree:
  """F = mean_i (∂ log softmax(f(x_i))_{y_i} / ∂θ)², a params-shaped tree."""

  def log_likelihood(params, image, label, _):
    return jax.nn.log_softmax(logits_fn(params, image[None])[0])[label]

  paths = list(tree_lib.flatten(params))
  sums = gradients.SquaredGradientSum(log_likelihood, params, paths, batch_size)(images, labels)
  return tree_lib.unflatten({p: s / len(images) for p, s in sums.items()})


def combine(task_vectors: Sequence[TaskVector], fishers: Sequence[common.PyTree]) -> TaskVector:
  """τ_m = Σ_t F_t ⊙ τ_t / Σ_t F_t (the plain mean where Σ_t F_t = 0); jit-able."""
  check_compatible(task_vectors, 'fisher')

  def weighted(*pairs):
    deltas, weights = pairs[:len(pairs) // 2], pairs[len(pairs) // 2:]
    total = sum(weights)
    mean = sum(deltas) / len(deltas)
    safe = jnp.where(total > 0, total, 1.0)
    return jnp.where(total > 0, sum(w * d for w, d in zip(weights, deltas)) / safe, mean)

  return common.merged(task_vectors, jax.tree.map(weighted, *[v.delta for v in task_vectors],
                                                *fishers))


@settings.declare(batch_size=settings.integer(32, '[1, inf)', 'examples per Fisher batch'))
def merge(task_vectors: Sequence[TaskVector], *, theta0: common.PyTree,
          data: Mapping[str, common.TaskData], batch_size: int) -> TaskVector:
  """Fisher merging; each task's Fisher is taken at θ0 + τ_t on its labeled `data`."""
  check_compatible(task_vectors, 'fisher')
  fishers = []
  for vector in task_vectors:
    task = common.labeled_task_of(vector, data, 'fisher')
    fishers.append(diagonal_fisher(task.logits_fn, vector.apply_to(theta0), task.images,
                                   task.labels, batch_size))
  return combine(task_vectors, fishers)
