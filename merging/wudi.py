"""WUDI merging: per layer, the update with the least interference measured on the task vectors.

Cheng et al., "Whoever Started the Interference Should End It: Guiding Data-Free Model Merging
via Task Vectors", ICML 2025. Per matrix layer (`ops.matrices`, W as (outputs, inputs)),

  τ_m = argmin_τ Σ_t ‖(τ − τ_t) τ_tᵀ‖²_F / ‖τ_t‖²_F,

started from Σ_t τ_t and run for `steps` Adam steps at `learning_rate` (FusionBench's wudi.py:
lr 1e-5, 400 steps in its config, weight decay 0); every other leaf is the mean of the τ_t.
Like FusionBench, every matrix is optimised (the authors' code only the four of each block and
leaves the rest at θ0). Applied at λ = 1: the method has no scaling coefficient. Adam reads the
interference's gradient in closed form (`gradient`), one matrix product a step where autodiff
of the loss would take about 2T.
"""

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops


def interference(merged: jax.Array, matrices: jax.Array) -> jax.Array:
  """Σ_t ‖(τ − τ_t) τ_tᵀ‖²_F / ‖τ_t‖²_F, the matrices stacked on the first axis (a zero τ_t,
  which nothing interferes with, adds 0 where the reference divides 0 by 0)."""
  gaps = jnp.einsum('toi,tpi->top', merged[None] - matrices, matrices)
  return jnp.sum(jnp.sum(gaps ** 2, axis=(1, 2)) * _inverse_norms(matrices))


def _inverse_norms(matrices: jax.Array) -> jax.Array:
  """1/‖τ_t‖²_F of each stacked matrix, 0 for a zero one."""
  norms = jnp.sum(matrices ** 2, axis=(1, 2))
  return jnp.where(norms > 0, 1.0 / jnp.where(norms > 0, norms, 1.0), 0.0)


def gradient(matrices: jax.Array):
  """τ ↦ the interference's gradient 2 Σ_t (τ − τ_t) τ_tᵀ τ_t / ‖τ_t‖²_F, with what does not
  depend on τ found once: as 2(τA − B), A = Σ_t τ_tᵀ τ_t / ‖τ_t‖²_F (inputs × inputs) and
  B = Σ_t τ_t τ_tᵀ τ_t / ‖τ_t‖²_F, one product a step, where A is no larger than the T
  products (outputs × outputs) of the other way, 2 Σ_t ((τ − τ_t) τ_tᵀ) τ_t / ‖τ_t‖²_F (a
  matrix of many more inputs than outputs). An LLM's token table (32,000 × 1,024) then costs
  one 32,000 × 1,024 × 1,024 product a step, no (outputs × outputs) one."""
  count, outputs, inputs = matrices.shape
  inverse = _inverse_norms(matrices)
  if inputs > 2 * count * outputs:
    return lambda merged: 2 * sum(
        inverse[t] * ((merged - matrices[t]) @ matrices[t].T) @ matrices[t] for t in range(count))
  a = jnp.einsum('toi,toj,t->ij', matrices, matrices, inverse)
  b = sum(inverse[t] * (matrices[t] @ (matrices[t].T @ matrices[t]) if outputs >= inputs
                        else (matrices[t] @ matrices[t].T) @ matrices[t]) for t in range(count))
  return lambda merged: 2 * (merged @ a - b)


@functools.partial(jax.jit, static_argnames=('steps', 'learning_rate'))
def solve(matrices: jax.Array, *, steps: int, learning_rate: float) -> jax.Array:
  """τ_m of one layer's stacked task matrices. With at most one non-zero τ_t, Σ_t τ_t is the
  minimum itself (no interference), where Adam would chase the rounding of τA − B: kept."""
  optimizer = optax.adam(learning_rate)
  grad = gradient(matrices)

  def step(_, carry):
    merged, state = carry
    updates, state = optimizer.update(grad(merged), state)
    return optax.apply_updates(merged, updates), state

  start = jnp.sum(matrices, axis=0)
  solved = jax.lax.fori_loop(0, steps, step, (start, optimizer.init(start)))[0]
  return jnp.where(jnp.count_nonzero(_inverse_norms(matrices)) > 1, solved, start)


@settings.declare(
    steps=settings.integer(400, '[0, inf)', 'Adam steps per layer'),
    learning_rate=settings.number(1e-5, '(0, inf)', "Adam's learning rate"))
def merge(task_vectors: Sequence[TaskVector], *, steps: int, learning_rate: float) -> TaskVector:
  """The WUDI merge τ_m, applied as it is."""
  check_compatible(task_vectors, 'wudi')
  return common.merged(task_vectors, ops.per_matrix(task_vectors, lambda ws: solve(
      jnp.stack(ws), steps=steps, learning_rate=learning_rate)))
