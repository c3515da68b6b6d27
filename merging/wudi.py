"""WUDI merging: per layer, the update with the least interference measured on the task vectors.

Cheng et al., "Whoever Started the Interference Should End It: Guiding Data-Free Model Merging
via Task Vectors", ICML 2025. Per matrix layer (`ops.matrices`, W as (outputs, inputs)),

  τ_m = argmin_τ Σ_t ‖(τ − τ_t) τ_tᵀ‖²_F / ‖τ_t‖²_F,

started from Σ_t τ_t and run for `steps` Adam steps at `learning_rate` (FusionBench's wudi.py:
lr 1e-5, 400 steps in its config, weight decay 0); every other leaf is the mean of the τ_t.
Like FusionBench, every matrix is optimised (the authors' code only the four of each block and
leaves the rest at θ0). Applied at λ = 1: the method has no scaling coefficient.
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


def interference(merged: jax.Array, matrices: jax.Array, grams: jax.Array | None) -> jax.Array:
  """Σ_t ‖(τ − τ_t) τ_tᵀ‖²_F / ‖τ_t‖²_F, the matrices stacked on the first axis (a zero τ_t,
  which nothing interferes with, adds 0 where the reference divides 0 by 0). For a matrix with
  more outputs than inputs, through ‖A Bᵀ‖²_F = ⟨AᵀA, BᵀB⟩ and `grams` (`inputs_gram` of the
  matrices): no (outputs × outputs) product is formed, 32,000² entries for an LLM's token
  table; `grams` is None for the others, whose (outputs × outputs) product is the smaller."""
  norms = jnp.sum(matrices ** 2, axis=(1, 2))
  gaps = merged[None] - matrices
  if grams is None:
    terms = jnp.sum(jnp.einsum('toi,tpi->top', gaps, matrices) ** 2, axis=(1, 2))
  else:
    terms = jnp.sum(inputs_gram(gaps) * grams, axis=(1, 2))
  return jnp.sum(terms / jnp.where(norms > 0, norms, 1.0))


def inputs_gram(matrices: jax.Array) -> jax.Array | None:
  """MᵀM (inputs × inputs) of each stacked matrix with more outputs than inputs, else None."""
  if matrices.shape[1] <= matrices.shape[2]:
    return None
  return jnp.einsum('toi,toj->tij', matrices, matrices)


@functools.partial(jax.jit, static_argnames=('steps', 'learning_rate'))
def solve(matrices: jax.Array, *, steps: int, learning_rate: float) -> jax.Array:
  """τ_m of one layer's stacked task matrices."""
  optimizer = optax.adam(learning_rate)
  grams = inputs_gram(matrices)

  def step(_, carry):
    merged, state = carry
    grads = jax.grad(interference)(merged, matrices, grams)
    updates, state = optimizer.update(grads, state)
    return optax.apply_updates(merged, updates), state

  merged = jnp.sum(matrices, axis=0)
  return jax.lax.fori_loop(0, steps, step, (merged, optimizer.init(merged)))[0]


@settings.declare(
    steps=settings.integer(400, '[0, inf)', 'Adam steps per layer'),
    learning_rate=settings.number(1e-5, '(0, inf)', "Adam's learning rate"))
def merge(task_vectors: Sequence[TaskVector], *, steps: int, learning_rate: float) -> TaskVector:
  """The WUDI merge τ_m, applied as it is."""
  check_compatible(task_vectors, 'wudi')
  return common.merged(task_vectors, ops.per_matrix(task_vectors, lambda ws: solve(
      jnp.stack(ws), steps=steps, learning_rate=learning_rate)))
