"""AdaMerging: learn the merge coefficients by minimising prediction entropy on unlabeled inputs.

Yang et al., "AdaMerging: Adaptive Model Merging for Multi-Task Learning", ICLR 2024:

  θ(λ) = θ0 + Σ_k λ_k τ_k                (task-wise: one λ per task vector)
  θ(λ) = θ0 + Σ_k λ_k^l τ_k^l            (layer-wise: one λ per task vector and leaf)
  min_λ Σ_t E_{x∼X_t} H(softmax f_t(x; θ(λ))),

with λ initialised at 0.3 and Adam (lr 1e-3) on batches of 16 unlabeled test inputs per task;
gradients flow through the merged params by `jax.grad`. No label is read. The coefficients are
not clipped (the paper states no bound). The result, Σ_k λ_k τ_k, is applied at λ = 1.
"""

import functools
from typing import Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from editing import settings
from editing import tree as tree_lib
from editing.errors import UserError
from editing.task_vector import TaskVector, check_compatible
from merging import common

GRANULARITIES = ('task', 'layer')
SETTINGS = dict(
    granularity=settings.choice('task', GRANULARITIES, 'one λ per task vector, or per leaf too'),
    steps=settings.integer(100, '[1, inf)', 'Adam steps on the entropy'),
    learning_rate=settings.number(1e-3, '(0, inf)', "Adam's learning rate for λ"),
    init=settings.number(0.3, '(-inf, inf)', "every λ's initial value"),
    batch_size=settings.integer(16, '[1, inf)', 'unlabeled inputs per task and step'))


class Learned(NamedTuple):
  coefficients: common.PyTree  # (K,) task-wise, or {path: (K,)} layer-wise
  entropies: list[float]  # the objective at each step, before its update


def merged_delta(task_vectors: Sequence[TaskVector], coefficients) -> common.PyTree:
  """Σ_k λ_k τ_k, with λ_k a scalar (task-wise) or one per leaf (layer-wise)."""
  if isinstance(coefficients, dict):
    return tree_lib.map_with_path(
        lambda path, *ds: sum(coefficients[path][k] * d for k, d in enumerate(ds)),
        *[v.delta for v in task_vectors])
  return jax.tree.map(lambda *ds: sum(coefficients[k] * d for k, d in enumerate(ds)),
                      *[v.delta for v in task_vectors])


def entropy(logits: jax.Array) -> jax.Array:
  """Mean over the batch of H(softmax(logits))."""
  log_p = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.sum(jnp.exp(log_p) * log_p, axis=-1))


@settings.declare(**SETTINGS)
def learn(task_vectors: Sequence[TaskVector], *, theta0: common.PyTree,
          data: Mapping[str, common.TaskData], key: jax.Array, granularity: str, steps: int,
          learning_rate: float, init: float, batch_size: int) -> Learned:
  """Fits the coefficients; `data[t].images` of every task t of the vectors are the inputs."""
  check_compatible(task_vectors, 'adamerging')
  tasks = {t: common.task_of(v, data, 'adamerging') for v in task_vectors for t in v.tasks}
  coefficients = initial_coefficients(len(task_vectors), theta0, granularity, init)
  tx, step = _step(tuple((t, d.logits_fn) for t, d in tasks.items()), learning_rate)
  opt_state = tx.init(coefficients)
  entropies = []
  for i in range(steps):
    batches = {t: batch(d.images, batch_size, jax.random.fold_in(
        jax.random.fold_in(key, i), tree_lib.stable_hash(t))) for t, d in tasks.items()}
    coefficients, opt_state, value = step(coefficients, opt_state, batches, theta0,
                                          list(task_vectors))
    entropies.append(float(value))
  return Learned(coefficients, entropies)


@functools.lru_cache(maxsize=16)
def _step(logits_fns: tuple[tuple[str, common.LogitsFn], ...], learning_rate: float):
  """(optimizer, jitted step), built once per task set and learning rate so that repeated
  merges reuse one compiled program.

  θ0 and the vectors are arguments, not closed-over constants: compiling megabytes of
  constants is slow, and as arguments every merge of same-shaped vectors shares one program.
  """
  tx = optax.adam(learning_rate)

  def objective(coefficients, batches, theta0, task_vectors):
    params = jax.tree.map(jnp.add, theta0, merged_delta(task_vectors, coefficients))
    return sum(entropy(logits_fn(params, batches[t])) for t, logits_fn in logits_fns)

  @jax.jit
  def step(coefficients, opt_state, batches, theta0, task_vectors):
    value, grads = jax.value_and_grad(objective)(coefficients, batches, theta0, task_vectors)
    updates, opt_state = tx.update(grads, opt_state, coefficients)
    return optax.apply_updates(coefficients, updates), opt_state, value

  return tx, step


def initial_coefficients(count: int, theta0: common.PyTree, granularity: str,
                         init: float) -> common.PyTree:
  """λ = init for each of `count` vectors: a (count,) array, or one per leaf of θ0."""
  if granularity not in GRANULARITIES:
    raise UserError(f'merge coefficient granularity must be one of {GRANULARITIES}, got '
                     f'{granularity!r}')
  coefficients = jnp.full((count,), init, jnp.float32)
  if granularity == 'layer':
    return {p: coefficients for p in tree_lib.flatten(theta0)}
  return coefficients


def batch(images: np.ndarray, size: int, key: jax.Array) -> np.ndarray:
  """`size` images (all, if fewer) drawn without replacement by `key`, in index order."""
  size = min(size, len(images))
  return images[np.sort(np.asarray(jax.random.permutation(key, len(images))[:size]))]


@settings.declare(**SETTINGS)
def merge(task_vectors: Sequence[TaskVector], *, theta0: common.PyTree,
          data: Mapping[str, common.TaskData], key: jax.Array, **learned_with) -> TaskVector:
  """Σ_k λ_k τ_k with the coefficients `learn` fits (`learned_with`: its settings)."""
  learned = learn(task_vectors, theta0=theta0, data=data, key=key, **learned_with)
  return common.merged(task_vectors, merged_delta(task_vectors, learned.coefficients))
