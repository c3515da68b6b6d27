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
τ_m is the result less θ0 (weights) or the result itself; applied at λ = 1. Every vector
above lies in the inputs' span, so the result is Σ_i c_i x_i with c found from the inputs'
Gram x_i·x_j alone (`coefficients`): a streamed merge sums the Gram over a tensor's blocks,
then merges a block at a time, and the in-memory merge takes the same path over the whole
tensor (the two agree within float32 summation; mergekit's order of operations, within
float32 rounding of its own).
"""

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import settings
from editing.errors import UserError
from editing.task_vector import TaskVector, check_compatible
from merging import common

EPS = 1e-8


def coefficients(gram: jax.Array, weights: Sequence[float], name: str = 'a tensor') -> jax.Array:
  """c with Multi-SLERP(x_1..x_N) = Σ_i c_i x_i, from the inputs' Gram G_ij = x_i·x_j.

  Every vector above lies in the span of the u_i = x_i/(‖x_i‖ + ε), so each is kept as its
  coefficients a in that basis, with inner products aᵀHb, H_ij = u_i·u_j = G_ij/((‖x_i‖ +
  ε)(‖x_j‖ + ε)): m̃ = Σ w_i u_i is w; m is μ = w/√(wᵀHw); u_i·m is (Hμ)_i; v is
  w − (Σ_i w_i (Hμ)_i) μ."""
  n = len(weights)
  if n == 1:
    return jnp.ones(1, jnp.float32)
  g = jnp.asarray(gram, jnp.float32)
  w = jnp.asarray(weights, jnp.float32)
  w = w / w.sum()
  norms = jnp.sqrt(jnp.maximum(jnp.diagonal(g), 0.0))
  scale = norms + EPS
  h = g / jnp.outer(scale, scale)
  mean_norm = jnp.sqrt(jnp.maximum(w @ h @ w, 0.0))
  if not isinstance(mean_norm, jax.core.Tracer):
    refuse_cancelling(float(mean_norm), float(norms.max()), n, name)
  mu = w / mean_norm
  tangent = w - jnp.sum(w * (h @ mu)) * mu
  length = jnp.sqrt(jnp.maximum(tangent @ h @ tangent, 0.0)) + EPS
  c = (mu * jnp.cos(length) + tangent * (jnp.sin(length) / length)) * jnp.sum(norms * w) / scale
  if n == 2:  # antipodal directions whose weights cancel: their weighted sum, as mergekit
    c = jnp.where(mean_norm < EPS, w, c)
  return jnp.where(norms.max() > 0, c, 0.0)  # all zero: zero, where mergekit refuses


def refuse_cancelling(mean_norm: float, largest_norm: float, count: int, name: str) -> None:
  """The refusal of more than two inputs whose weighted mean of directions vanishes."""
  if count > 2 and largest_norm > 0 and mean_norm < EPS:
    raise UserError(f'multislerp: the weighted mean of the directions of {name} is zero '
                    '(antipodal inputs whose weights cancel); give other weights')


def check_sums(totals: np.ndarray, name: str, weights: Sequence[float] | None) -> None:
  """Refuses a tensor's Gram (`sums`, found by a streamed merge before its blocks merge under
  jit) that `coefficients` cannot merge from."""
  coefficients(np.asarray(totals), [1.0] * len(totals) if weights is None else weights, name)


def streamed_sums(task_space: bool, **_):
  """What a streamed merge sums over a tensor's blocks before it merges them
  (`merging.Method`): the Gram of the points."""
  return common.gram_sums(task_space)


@settings.declare(task_space=settings.flag(True, "interpolate the task vectors (mergekit "
                                           "given a base model); else the models' weights"))
def merge(task_vectors: Sequence[TaskVector], *, theta0, task_space: bool,
          weights: Sequence[float] | None = None, totals: dict | None = None) -> TaskVector:
  """τ_m of the Multi-SLERP of the task vectors' models (or of the vectors); `totals`, each
  leaf's Gram found beforehand (a streamed block's, of its whole tensor)."""
  check_compatible(task_vectors, 'multislerp')
  weights = [1.0] * len(task_vectors) if weights is None else list(weights)
  common.check_weights(weights, len(task_vectors), 'multislerp')
  if abs(sum(weights)) < 1e-12:
    raise UserError(f'multislerp: weights {weights} sum to zero; they are normalised to sum 1')
  return common.merged(task_vectors, common.interpolated(
      task_vectors, theta0, task_space, lambda points, path: common.combination(
          points, coefficients(common.gram(points) if totals is None else totals[path],
                               weights, path))))
