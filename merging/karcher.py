"""The Karcher mean: the Riemannian centre of mass of N models on the hypersphere, rescaled by
their mean norm.

Karcher, "Riemannian center of mass and mollifier smoothing", 1977, as mergekit's `karcher`
merges, per tensor, with equal weights α_i = 1/N of the models' weights x_i = θ_i (or, with
`task_space`, their task vectors; mergekit has no base model here):

  u_i = x_i/‖x_i‖ (inputs of norm ≤ tol left out), u ← Σ α_i u_i normalised (u_1 if that is
  below tol), then up to `max_iter` times:
    V = Σ_i α_i θ_i/sin θ_i · (u_i − cos θ_i u),  θ_i = arccos(u·u_i) (terms with θ_i < tol
    left out), stop once ‖V‖ < tol, else u ← cos‖V‖ u + sin‖V‖ V/‖V‖, renormalised;
  result = (Σ_i α_i ‖x_i‖) · u      (every input's norm, the left-out ones too).

τ_m is the result less θ0 (weights) or the result itself; applied at λ = 1. u stays in the
inputs' span, so the result is Σ_i c_i x_i with c found from the inputs' Gram x_i·x_j alone
(`coefficients`, its steps a while loop under jit): a streamed merge sums the Gram over a
tensor's blocks, then merges a block at a time, and the in-memory merge takes the same path
over the whole tensor.
"""

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common


@functools.partial(jax.jit, static_argnames='max_iter')
def coefficients(gram: jax.Array, max_iter: int, tol: float) -> jax.Array:
  """c with Karcher(x_1..x_N) = Σ_i c_i x_i, from the inputs' Gram G_ij = x_i·x_j.

  u and V stay in the span of the included u_i = x_i/‖x_i‖, so each is kept as its
  coefficients a in that basis, with inner products aᵀHb, H_ij = u_i·u_j = G_ij/(‖x_i‖‖x_j‖):
  u·u_i is (Hμ)_i, and V is Σ_i f_i (e_i − cos θ_i μ), f_i = θ_i/(K sin θ_i)."""
  g = jnp.asarray(gram, jnp.float32)
  n = g.shape[0]
  if n == 1:
    return jnp.ones(1, jnp.float32)
  norms = jnp.sqrt(jnp.maximum(jnp.diagonal(g), 0.0))
  included = norms > tol
  count = jnp.sum(included)
  safe = jnp.where(included, norms, 1.0)
  h = jnp.where(jnp.outer(included, included), g / jnp.outer(safe, safe), 0.0)
  length_of = lambda a: jnp.sqrt(jnp.maximum(a @ h @ a, 0.0))
  mean = included / jnp.maximum(count, 1)
  first = jnp.arange(n) == jnp.argmax(included)
  mu = jnp.where(length_of(mean) < tol, first.astype(jnp.float32), mean / length_of(mean))

  def step(carry):
    i, mu, _ = carry
    cos = jnp.clip(h @ mu, -1.0, 1.0)
    theta = jnp.arccos(cos)
    active = included & (theta >= tol)
    f = jnp.where(active, theta / jnp.where(active, jnp.sin(theta), 1.0), 0.0) / count
    v = f - jnp.sum(f * cos) * mu
    length = length_of(v)
    done = length < tol
    moved = jnp.cos(length) * mu + jnp.sin(length) * v / jnp.where(done, 1.0, length)
    moved = jnp.where(length_of(moved) > tol, moved / length_of(moved), moved)
    return i + 1, jnp.where(done, mu, moved), done

  _, mu, _ = jax.lax.while_loop(lambda c: (c[0] < max_iter) & ~c[2], step,
                                (0, mu, jnp.array(False)))
  return jnp.where(count > 0, jnp.sum(norms) / n * mu / safe, 0.0)


def streamed_sums(task_space: bool, **_):
  """What a streamed merge sums over a tensor's blocks before it merges them
  (`merging.Method`): the Gram of the points."""
  return common.gram_sums(task_space)


@settings.declare(
    max_iter=settings.integer(10, '[1, 1000]', 'the most Riemannian steps per tensor'),
    tol=settings.number(1e-5, '(0, 1)', 'the step length (and norms, angles) below which it '
                        'stops'),
    task_space=settings.flag(False, "average the task vectors; else the models' weights, as "
                             'mergekit does'))
def merge(task_vectors: Sequence[TaskVector], *, theta0, max_iter: int, tol: float,
          task_space: bool, totals: dict | None = None) -> TaskVector:
  """τ_m of the Karcher mean of the task vectors' models (or of the vectors); `totals`, each
  leaf's Gram found beforehand (a streamed block's, of its whole tensor)."""
  check_compatible(task_vectors, 'karcher')
  return common.merged(task_vectors, common.interpolated(
      task_vectors, theta0, task_space, lambda points, path: common.combination(
          points, coefficients(common.gram(points) if totals is None else totals[path],
                               max_iter, tol))))
