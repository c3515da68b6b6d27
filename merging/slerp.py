"""SLERP: the fine-tuned model's weights interpolated along the great circle from θ0's.

Shoemake, "Animating rotation with quaternion curves", SIGGRAPH 1985, as mergekit's `slerp`
merges two models, per tensor, each flattened to a vector (a = θ0's, b = θ_1's):

  cos Ω = â·b̂ (â = a/‖a‖ where ‖a‖ > 1e-8),
  slerp(a, b; t) = sin((1 − t)Ω)/sin Ω · a + sin(tΩ)/sin Ω · b,

and (1 − t)·a + t·b where |cos Ω| > 0.9995 (nearly colinear). t = 0 gives θ0, t = 1 the
fine-tuned model; τ_m = slerp(θ0, θ0 + τ_1; t) − θ0, applied at λ = 1. Ω is read from three
sums over the tensor (`sums`), so a streamed merge finds them in a pass over its blocks and
then interpolates a block at a time.
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from editing import settings
from editing import tree as tree_lib
from editing.task_vector import TaskVector, check_compatible
from merging import common

COLINEAR = 0.9995  # |cos Ω| above which mergekit interpolates linearly


def sums(theta0: jax.Array, deltas: Sequence[jax.Array]) -> jax.Array:
  """‖a‖², ‖b‖² and a·b of a leaf (a = θ0's, b = θ_1's), in float32: sums over its entries, so
  a streamed merge adds them block by block and merges each block from the whole leaf's."""
  a = jnp.asarray(theta0, jnp.float32)
  b = a + jnp.asarray(deltas[0], jnp.float32)
  return jnp.stack([jnp.sum(a * a), jnp.sum(b * b), jnp.sum(a * b)])


def streamed_sums(**_):
  """What a streamed merge sums over a tensor's blocks before it merges them (`merging.Method`)."""
  return sums


def interpolate(t: float, a: jax.Array, b: jax.Array, totals: jax.Array,
                eps: float = 1e-8) -> jax.Array:
  """slerp(a, b; t) of two arrays read as flat vectors, in float32, from their `sums`."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  norm_a, norm_b = jnp.sqrt(totals[0]), jnp.sqrt(totals[1])
  # â·b̂, where a vector no longer than eps is left as it is (mergekit's normalize).
  cos = totals[2] / (jnp.where(norm_a > eps, norm_a, 1.0) * jnp.where(norm_b > eps, norm_b, 1.0))
  omega = jnp.arccos(jnp.clip(cos, -1.0, 1.0))
  spherical = (jnp.sin((1 - t) * omega) * a + jnp.sin(t * omega) * b) / jnp.sin(omega)
  return jnp.where(jnp.abs(cos) > COLINEAR, (1 - t) * a + t * b, spherical)


@settings.declare(t=settings.number(0.5, '[0, 1]', 'how far from θ0 toward the fine-tuned '
                                    'model, along the great circle'))
def merge(task_vectors: Sequence[TaskVector], *, theta0, t: float,
          totals: dict | None = None) -> TaskVector:
  """τ_m = slerp(θ0, θ0 + τ_1; t) − θ0 of the one task vector; `totals`, each leaf's `sums`
  found beforehand (a streamed block's, of its whole tensor)."""
  check_compatible(task_vectors, 'slerp')
  common.check_one_model(task_vectors, 'slerp', ' (nuslerp takes two, multislerp any)')
  base = tree_lib.flatten(theta0)

  def leaf(path, d):
    found = sums(base[path], [d]) if totals is None else totals[path]
    return interpolate(t, base[path], base[path] + d, found) - base[path]

  return common.merged(task_vectors, tree_lib.map_with_path(leaf, task_vectors[0].delta))
