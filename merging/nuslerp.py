"""NuSLERP: SLERP of two models (or their task vectors) with weights, whole or row by row.

mergekit's `nuslerp`, per tensor: t = w_2 / (w_1 + w_2) (1/2 where the sum is below 1e-6),
x_i the models' weights θ_i, or with `task_space` (mergekit given a base model) their task
vectors τ_i, then

  slerp(x_1, x_2; t) = (sin((1 − t)Ω) x_1 + sin(tΩ) x_2) / sin Ω,  cos Ω = x̂_1·x̂_2,

and the lerp (1 − t)x_1 + t·x_2 where |sin Ω| < 1e-8. With `flatten` (default) a tensor is one
vector; else each vector along the last axis of a layer's (outputs, inputs) matrix, or with
`row_wise` along its first (mergekit's code: its docs call the latter "row vectors").
τ_m is the result less θ0 (weights) or the result itself (task vectors); applied at λ = 1.
With `flatten`, Ω is read from the two points' Gram (`coefficients`), so a streamed merge
sums it over a tensor's blocks, then interpolates a block at a time.
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from editing import settings
from editing.errors import UserError
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops


def interpolate(t: float, x1: jax.Array, x2: jax.Array, eps: float = 1e-8) -> jax.Array:
  """slerp(x_1, x_2; t) of each vector along the last axis."""
  unit = lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-7)
  omega = jnp.arccos(jnp.clip(jnp.sum(unit(x1) * unit(x2), axis=-1, keepdims=True), -1, 1))
  sin = jnp.sin(omega)
  spherical = (jnp.sin((1 - t) * omega) * x1 + jnp.sin(t * omega) * x2) / sin
  return jnp.where(jnp.abs(sin) < eps, (1 - t) * x1 + t * x2, spherical)


def interpolate_leaf(t: float, x1: jax.Array, x2: jax.Array, view: ops.Matrix | None,
                     row_wise: bool) -> jax.Array:
  """One tensor's NuSLERP vector by vector, read as `row_wise` and `view` say."""
  x1, x2 = jnp.asarray(x1, jnp.float32), jnp.asarray(x2, jnp.float32)
  of = view.of if view is not None else (lambda x: x)
  back = (lambda w: view.back(w, x1.shape)) if view is not None else (lambda w: w)
  axis = 0 if row_wise else -1
  moved = [jnp.moveaxis(of(x), axis, -1) for x in (x1, x2)]
  return back(jnp.moveaxis(interpolate(t, *moved), -1, axis))


def coefficients(gram: jax.Array, t: float, eps: float = 1e-8) -> jax.Array:
  """c with slerp(x_1, x_2; t) = c_1 x_1 + c_2 x_2 of two flattened tensors, from their Gram."""
  g = jnp.asarray(gram, jnp.float32)
  norms = jnp.maximum(jnp.sqrt(jnp.maximum(jnp.diagonal(g), 0.0)), 1e-7)
  omega = jnp.arccos(jnp.clip(g[0, 1] / (norms[0] * norms[1]), -1, 1))
  sin = jnp.sin(omega)
  spherical = jnp.stack([jnp.sin((1 - t) * omega), jnp.sin(t * omega)]) / sin
  return jnp.where(jnp.abs(sin) < eps, jnp.array([1 - t, t], jnp.float32), spherical)


def streamed_sums(flatten: bool, task_space: bool, **_):
  """What a streamed merge sums over a tensor's blocks before it merges them
  (`merging.Method`): the Gram of the two points where each tensor is one vector; none
  vector by vector (each tensor is merged whole)."""
  return common.gram_sums(task_space) if flatten else None


@settings.declare(
    flatten=settings.flag(True, 'each tensor as one vector; else vector by vector'),
    row_wise=settings.flag(False, "without flatten, the vectors along a matrix's first axis "
                           '(its columns); else its last (its rows)'),
    task_space=settings.flag(True, "interpolate the task vectors (mergekit given a base "
                             "model); else the models' weights"))
def merge(task_vectors: Sequence[TaskVector], *, theta0, flatten: bool, row_wise: bool,
          task_space: bool, weights: Sequence[float] | None = None,
          totals: dict | None = None) -> TaskVector:
  """τ_m of NuSLERP between the two task vectors' models (or the vectors themselves);
  `totals`, with `flatten`, each leaf's Gram found beforehand (a streamed block's, of its
  whole tensor)."""
  check_compatible(task_vectors, 'nuslerp')
  if len(task_vectors) != 2:
    raise UserError(f'nuslerp interpolates two models; got {len(task_vectors)} task vectors '
                    '(slerp takes one, multislerp any)')
  weights = [1.0, 1.0] if weights is None else list(weights)
  common.check_weights(weights, 2, 'nuslerp')
  t = 0.5 if abs(sum(weights)) < 1e-6 else weights[1] / sum(weights)
  if flatten:
    merge_leaf = lambda ends, path: common.combination(ends, coefficients(
        common.gram(ends) if totals is None else totals[path], t))
  else:
    views = ops.matrices(task_vectors[0].delta)
    merge_leaf = lambda ends, path: interpolate_leaf(t, *ends, views[path], row_wise)
  return common.merged(task_vectors, common.interpolated(task_vectors, theta0, task_space,
                                                         merge_leaf))
