"""AdaMerging: learn the merge coefficients by minimising prediction entropy on unlabeled inputs.

Yang et al., "AdaMerging: Adaptive Model Merging for Multi-Task Learning", ICLR 2024:

  θ(λ) = θ0 + Σ_k λ_k τ_k                (task-wise: one λ per task vector)
  θ(λ) = θ0 + Σ_k λ_k^l τ_k^l            (layer-wise: one λ per task vector and leaf)
  min_λ Σ_t E_{x∼X_t} H(softmax f_t(x; θ(λ))),

with λ initialised at 0.3 and Adam (lr 1e-3) on batches of 16 unlabeled test inputs per task;
gradients flow through the merged params by `jax.grad`. No label is read. The coefficients are
not clipped (the paper states no bound). The result, Σ_k λ_k τ_k, is applied at λ = 1.

The step is compiled once for every merge of the same shapes, whatever the vectors, heads and
learning rate (`compiled_once`).
"""

import functools
from typing import Callable, Mapping, NamedTuple, Sequence

import jax
from jax.extend import core as jax_core
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
  return _weighted_sum([v.delta for v in task_vectors], coefficients)


def _weighted_sum(deltas: Sequence[common.PyTree], coefficients) -> common.PyTree:
  if isinstance(coefficients, dict):
    return tree_lib.map_with_path(
        lambda path, *ds: sum(coefficients[path][k] * d for k, d in enumerate(ds)), *deltas)
  return jax.tree.map(lambda *ds: sum(coefficients[k] * d for k, d in enumerate(ds)), *deltas)


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
  logits_fns = [d.logits_fn for d in tasks.values()]
  # The learning rate is state rather than a constant of the program, which is then the same
  # for every learning rate.
  tx = optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate)

  def step(coefficients, opt_state, batches, theta0, deltas):
    def objective(coefficients):
      params = jax.tree.map(jnp.add, theta0, _weighted_sum(deltas, coefficients))
      return sum(entropy(f(params, b)) for f, b in zip(logits_fns, batches))

    value, grads = jax.value_and_grad(objective)(coefficients)
    updates, opt_state = tx.update(grads, opt_state, coefficients)
    return optax.apply_updates(coefficients, updates), opt_state, value

  opt_state = tx.init(coefficients)
  # Deltas rather than vectors, whose task names would be part of the program; every batch
  # has the shape of a task's first `batch_size` images.
  deltas = [v.delta for v in task_vectors]
  step = compiled_once(step, coefficients, opt_state,
                       [d.images[:batch_size] for d in tasks.values()], theta0, deltas)
  entropies = []
  for i in range(steps):
    batches = list(step_batches(tasks, batch_size, key, i).values())
    coefficients, opt_state, value = step(coefficients, opt_state, batches, theta0, deltas)
    entropies.append(float(value))
  return Learned(coefficients, entropies)


def compiled_once(fn: Callable, *args) -> Callable:
  """fn, compiled for arguments shaped and placed like `args`, once for every call that
  builds the same program.

  The arrays fn reads from its closure (the heads and θ0 that the merge job's logits
  functions close over) become arguments of the program rather than constants in it, so
  closures built anew for every merge, over other arrays of the same shapes, lower to the
  same program; programs are told apart by their StableHLO text and argument and result
  structures, as JAX's persistent compilation cache tells them apart.
  """
  closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
  jaxpr, consts = closed.jaxpr, closed.consts
  hoisted = jax.jit(lambda constants, *inputs: jax_core.jaxpr_as_fun(
      jax_core.ClosedJaxpr(jaxpr, constants))(*jax.tree.leaves(inputs)))
  compiled = _compile(_Program(hoisted.lower(consts, *args)))
  results = jax.tree.structure(shapes)
  return lambda *args: jax.tree.unflatten(results, compiled(consts, *args))


class _Program:
  """A lowered program, equal to another of the same text and argument and result structures."""

  def __init__(self, lowered: jax.stages.Lowered):
    self.lowered = lowered
    self._key = (lowered.as_text(), lowered.in_tree, lowered.out_tree)

  def __eq__(self, other):
    return isinstance(other, _Program) and self._key == other._key

  def __hash__(self):
    return hash(self._key)


@functools.lru_cache(maxsize=16)
def _compile(program: _Program) -> jax.stages.Compiled:
  return program.lowered.compile()


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


def step_batches(tasks: Mapping[str, common.TaskData], size: int, key: jax.Array,
                 step: int) -> dict[str, np.ndarray]:
  """{task: its `batch` of step `step`}, each task's drawn by its own key of that step."""
  step_key = jax.random.fold_in(key, step)
  return {t: batch(d.images, size, jax.random.fold_in(step_key, tree_lib.stable_hash(t)))
          for t, d in tasks.items()}


@settings.declare(**SETTINGS)
def merge(task_vectors: Sequence[TaskVector], *, theta0: common.PyTree,
          data: Mapping[str, common.TaskData], key: jax.Array, **learned_with) -> TaskVector:
  """Σ_k λ_k τ_k with the coefficients `learn` fits (`learned_with`: its settings)."""
  learned = learn(task_vectors, theta0=theta0, data=data, key=key, **learned_with)
  return common.merged(task_vectors, merged_delta(task_vectors, learned.coefficients))
