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


def coefficients(squares_1, squares_2, dot, t: float, eps: float = 1e-8) -> tuple:
  """(c_1, c_2) with slerp(x_1, x_2; t) = c_1 x_1 + c_2 x_2, from ‖x_1‖², ‖x_2‖² and x_1·x_2
  (arrays of them, one per pair of vectors, or the Gram's entries of two flattened tensors)."""
  norm = lambda squares: jnp.maximum(jnp.sqrt(jnp.maximum(squares, 0.0)), 1e-7)
  omega = jnp.arccos(jnp.clip(dot / (norm(squares_1) * norm(squares_2)), -1, 1))
  sin = jnp.sin(omega)
  colinear = jnp.abs(sin) < eps
  return (jnp.where(colinear, 1 - t, jnp.sin((1 - t) * omega) / sin),
          jnp.where(colinear, t, jnp.sin(t * omega) / sin))


def interpolate(t: float, x1: jax.Array, x2: jax.Array) -> jax.Array:
  """slerp(x_1, x_2; t) of each vector along the last axis."""
  total = lambda x: jnp.sum(x, axis=-1, keepdims=True)
  c1, c2 = coefficients(total(x1 * x1), total(x2 * x2), total(x1 * x2), t)
  return c1 * x1 + c2 * x2


def interpolate_leaf(t: float, x1: jax.Array, x2: jax.Array, view: ops.Matrix | None,
                     row_wise: bool) -> jax.Array:
  """One tensor's NuSLERP vector by vector, read as `row_wise` and `view` say."""
  x1, x2 = jnp.asarray(x1, jnp.float32), jnp.asarray(x2, jnp.float32)
  of = view.of if view is not None else (lambda x: x)
  back = (lambda w: view.back(w, x1.shape)) if view is not None else (lambda w: w)
  axis = 0 if row_wise else -1
  moved = [jnp.moveaxis(of(x), axis, -1) for x in (x1, x2)]
  return back(jnp.moveaxis(interpolate(t, *moved), -1, axis))


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
    def merge_leaf(ends, path):
      g = common.gram(ends) if totals is None else totals[path]
      return common.combination(ends, jnp.stack(coefficients(g[0, 0], g[1, 1], g[0, 1], t)))
  else:
    views = ops.matrices(task_vectors[0].delta)
    merge_leaf = lambda ends, path: interpolate_leaf(t, *ends, views[path], row_wise)
  return common.merged(task_vectors, common.interpolated(task_vectors, theta0, task_space,
                                                         merge_leaf))
