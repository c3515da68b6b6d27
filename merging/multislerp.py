"""Multi-SLERP: the weighted mean of N models (or task vectors) on the hypersphere, through
the tangent space at their weighted Euclidean mean direction.

mergekit's `multislerp`, per tensor, each flattened (x_i the models' weights θ_i, or with
`task_space` their task vectors τ_i; weights w normalised to sum 1):

  u_i = x_i / (‖x_i‖ + ε),  m = Σ_i w_i u_i / ‖Σ_i w_i u_i‖,
  v = Σ_i w_i (u_i − (u_i·m) m),
  result = (m cos‖v‖ + v sin‖v‖/‖v‖) · Σ_i w_i ‖x_i‖      (‖v‖ taken + ε),

with ε = 1e-8. Where the weighted mean of directions vanishes (antipodal inputs), two inputs
fall back to their weighted sum and more are refused, as in mergekit; inputs that are all
zero (a tensor that no fine-tuning changed) give zero, where mergekit refuses them too.
τ_m is the result less θ0 (weights) or the result itself; applied at λ = 1. The norms are
tested on the host, so the merge runs eagerly, not under jit.
"""

from typing import Sequence

import jax.numpy as jnp

from editing import settings
from editing.errors import UserError
from editing.task_vector import TaskVector, check_compatible
from merging import common

EPS = 1e-8


def interpolate(xs: Sequence, weights: Sequence[float], name: str = 'a tensor') -> jnp.ndarray:
  """The Multi-SLERP of one tensor's inputs `xs`, in float32."""
  shape = jnp.shape(xs[0])
  if len(xs) == 1:
    return jnp.asarray(xs[0], jnp.float32)
  flat = jnp.stack([jnp.asarray(x, jnp.float32).ravel() for x in xs])
  w = jnp.asarray(weights, jnp.float32)
  w = w / w.sum()
  norms = jnp.linalg.norm(flat, axis=1, keepdims=True)
  if not float(norms.max()):
    return jnp.zeros(shape, jnp.float32)
  units = flat / (norms + EPS)
  mean = (units * w[:, None]).sum(0)
  if float(jnp.linalg.norm(mean)) < EPS:
    if len(xs) == 2:
      return (w[0] * flat[0] + w[1] * flat[1]).reshape(shape)
    raise UserError(f'multislerp: the weighted mean of the directions of {name} is zero '
                    '(antipodal inputs whose weights cancel); give other weights')
  mean = mean / jnp.linalg.norm(mean)
  tangent = ((units - (units @ mean)[:, None] * mean) * w[:, None]).sum(0)
  length = jnp.linalg.norm(tangent) + EPS
  result = mean * jnp.cos(length) + tangent * (jnp.sin(length) / length)
  return (result * (norms[:, 0] * w).sum()).reshape(shape)


@settings.declare(task_space=settings.flag(True, "interpolate the task vectors (mergekit "
                                           "given a base model); else the models' weights"))
def merge(task_vectors: Sequence[TaskVector], *, theta0, task_space: bool,
          weights: Sequence[float] | None = None) -> TaskVector:
  """τ_m of the Multi-SLERP of the task vectors' models (or of the vectors)."""
  check_compatible(task_vectors, 'multislerp')
  weights = [1.0] * len(task_vectors) if weights is None else list(weights)
  common.check_weights(weights, len(task_vectors), 'multislerp')
  if abs(sum(weights)) < 1e-12:
    raise UserError(f'multislerp: weights {weights} sum to zero; they are normalised to sum 1')
  return common.merged(task_vectors, common.interpolated(
      task_vectors, theta0, task_space, lambda points, path: interpolate(points, weights, path)))
