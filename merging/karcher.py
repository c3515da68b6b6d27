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

τ_m is the result less θ0 (weights) or the result itself; applied at λ = 1. Its stopping
tests run on the host, so the merge runs eagerly, not under jit.
"""

import math
from typing import Sequence

import jax.numpy as jnp

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common


def mean(xs: Sequence, max_iter: int, tol: float) -> jnp.ndarray:
  """The Karcher mean of one tensor's inputs, in float32."""
  shape = jnp.shape(xs[0])
  if len(xs) == 1:
    return jnp.asarray(xs[0], jnp.float32)
  flat = [jnp.asarray(x, jnp.float32).ravel() for x in xs]
  norms = [float(jnp.linalg.norm(x)) for x in flat]
  alpha = 1.0 / len(xs)
  units = [x / n for x, n in zip(flat, norms) if n > tol]
  if not units:
    return jnp.zeros(shape, jnp.float32)
  u = sum(units) / len(units)
  u = units[0] if float(jnp.linalg.norm(u)) < tol else u / jnp.linalg.norm(u)
  for _ in range(max_iter):
    v = jnp.zeros_like(u)
    for unit in units:
      cos = jnp.clip(jnp.dot(u, unit), -1.0, 1.0)
      theta = float(jnp.arccos(cos))
      if theta >= tol:
        v = v + (1.0 / len(units)) * (theta / math.sin(theta)) * (unit - cos * u)
    length = jnp.linalg.norm(v)
    if float(length) < tol:
      break
    u = jnp.cos(length) * u + jnp.sin(length) * (v / length)
    if float(jnp.linalg.norm(u)) > tol:
      u = u / jnp.linalg.norm(u)
  return (alpha * sum(norms) * u).reshape(shape)


@settings.declare(
    max_iter=settings.integer(10, '[1, 1000]', 'the most Riemannian steps per tensor'),
    tol=settings.number(1e-5, '(0, 1)', 'the step length (and norms, angles) below which it '
                        'stops'),
    task_space=settings.flag(False, "average the task vectors; else the models' weights, as "
                             'mergekit does'))
def merge(task_vectors: Sequence[TaskVector], *, theta0, max_iter: int, tol: float,
          task_space: bool) -> TaskVector:
  """τ_m of the Karcher mean of the task vectors' models (or of the vectors)."""
  check_compatible(task_vectors, 'karcher')
  return common.merged(task_vectors, common.interpolated(
      task_vectors, theta0, task_space, lambda points, _: mean(points, max_iter, tol)))
