"""What every merging method shares: the merged vector's provenance, and the data the
data-driven methods read. (Input checks: `editing.task_vector.check_compatible`.)"""

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import settings as settings_lib
from editing import tree as tree_lib
from editing.errors import UserError
from editing.task_vector import TaskVector

PyTree = Any
# logits_fn(params, images) -> (batch, classes): the regime's encoder and the task's frozen head
LogitsFn = Callable[[PyTree, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True, eq=False)
class TaskData:
  """One task's data for a data-driven merge (Fisher, RegMean, AdaMerging).

  Attributes:
    logits_fn: logits_fn(params, images) of the full params tree (θ0 + a merged τ).
    images: float32 inputs (N, H, W, C); unlabeled unless `labels` is given.
    labels: int labels, read only by methods that need them (Fisher); None otherwise.
  """

  logits_fn: LogitsFn
  images: np.ndarray
  labels: np.ndarray | None = None


def check_one_model(task_vectors: Sequence, method: str, others: str = '') -> None:
  """An error unless there is one task vector: `method` merges one fine-tuned model into the
  base (`others`, a pointer to the methods that take more)."""
  if len(task_vectors) != 1:
    raise UserError(f'{method} merges one fine-tuned model into the base; got '
                    f'{len(task_vectors)} task vectors{others}')


def check_weights(weights: Sequence[float], count: int, method: str) -> None:
  """One finite weight per task vector, not all zero."""
  if len(weights) != count or not all(np.isfinite(w) for w in weights) or not any(weights):
    raise UserError(f'{method}: weights {list(weights)} must be {count} finite numbers, one per '
                    'task vector, not all zero')


def per_vector(values: Mapping[str, Sequence] | None, settings: Mapping[str, Any], count: int,
               method: Callable, name: str) -> list[dict[str, Any]]:
  """Each of `count` task vectors' settings: the merge's `settings`, but those `values` gives
  one per vector (mergekit's per-model parameters), each vector's checked as `method` declares
  them (its ranges and constraint)."""
  values = dict(values or {})
  unknown = sorted(set(values) - set(settings))
  if unknown:
    raise UserError(f'{name}: per_vector {unknown} are not settings given per vector here; '
                    f'those that may be: {sorted(settings)}')
  for key, given in values.items():
    if len(given) != count:
      raise UserError(f'{name}: per_vector.{key} has {len(given)} values for {count} task '
                      'vectors')
  return [settings_lib.check(method, {**settings, **{k: v[i] for k, v in values.items()}},
                             f'{name}.per_vector[{i}]') for i in range(count)]


def interpolated(task_vectors: Sequence[TaskVector], theta0: PyTree, task_space: bool,
                 interpolate: Callable[[list, str], jax.Array]) -> PyTree:
  """Per leaf, interpolate(points, path) of the task vectors' leaves (`task_space`), or of the
  models' weights θ0 + τ_t less θ0: an interpolation of weights, as a task vector."""
  base = tree_lib.flatten(theta0)

  def leaf(path, *deltas):
    if task_space:
      return interpolate(list(deltas), path)
    x = jnp.asarray(base[path], jnp.float32)
    return interpolate([x + d for d in deltas], path) - x

  return tree_lib.map_with_path(leaf, *[v.delta for v in task_vectors])


def gram(points: Sequence[jax.Array]) -> jax.Array:
  """G_ij = x_i·x_j of the points read as flat vectors, in float32: sums over their entries,
  from which the spherical merges find their norms and angles (a streamed merge adds a tensor's
  blocks' before it merges them; the zero padding of a last block adds nothing)."""
  x = jnp.stack([jnp.asarray(p, jnp.float32).ravel() for p in points])
  return jnp.matmul(x, x.T, precision=jax.lax.Precision.HIGHEST)


def gram_sums(task_space: bool) -> Callable:
  """sums(theta0, deltas) of a leaf, the `gram` of the points `interpolated` merges: the task
  vectors (`task_space`) or the models' weights θ0 + τ_t."""
  return lambda theta0, deltas: gram(list(deltas) if task_space else
                                     [theta0 + d for d in deltas])


def combination(points: Sequence[jax.Array], coefficients: jax.Array) -> jax.Array:
  """Σ_i c_i x_i, in float32: a spherical merge's result, which lies in its inputs' span."""
  return sum(coefficients[i] * jnp.asarray(x, jnp.float32) for i, x in enumerate(points))


def merged(task_vectors: Sequence[TaskVector], delta: PyTree) -> TaskVector:
  """A vector carrying `delta` and the union of the inputs' tasks, regime and base."""
  tasks = tuple(dict.fromkeys(t for v in task_vectors for t in v.tasks))
  first = task_vectors[0]
  return TaskVector(delta, tasks, first.regime, first.base)


def task_of(vector: TaskVector, data: Mapping[str, TaskData], method: str) -> TaskData:
  """The data of a single-task vector's task."""
  if len(vector.tasks) != 1 or vector.tasks[0] not in data:
    raise UserError(f'{method} needs single-task vectors with data for their task; got tasks '
                     f'{vector.tasks}, data for {sorted(data)}')
  return data[vector.tasks[0]]


def labeled_task_of(vector: TaskVector, data: Mapping[str, TaskData], method: str) -> TaskData:
  """The labeled data of a single-task vector's task."""
  task = task_of(vector, data, method)
  if task.labels is None:
    raise UserError(f'{method} needs labeled data for task {vector.tasks[0]}')
  return task
