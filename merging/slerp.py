"""SLERP: the fine-tuned model's weights interpolated along the great circle from θ0's.

Shoemake, "Animating rotation with quaternion curves", SIGGRAPH 1985, as mergekit's `slerp`
merges two models, per tensor, each flattened to a vector (a = θ0's, b = θ_1's):

  cos Ω = â·b̂ (â = a/‖a‖ where ‖a‖ > 1e-8),
  slerp(a, b; t) = sin((1 − t)Ω)/sin Ω · a + sin(tΩ)/sin Ω · b,

and (1 − t)·a + t·b where |cos Ω| > 0.9995 (nearly colinear). t = 0 gives θ0, t = 1 the
fine-tuned model; τ_m = slerp(θ0, θ0 + τ_1; t) − θ0, applied at λ = 1.
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from editing import settings
from editing import tree as tree_lib
from editing.task_vector import TaskVector, check_compatible
from merging import common

COLINEAR = 0.9995  # |cos Ω| above which mergekit interpolates linearly


def interpolate(t: float, a: jax.Array, b: jax.Array, eps: float = 1e-8) -> jax.Array:
  """slerp(a, b; t) of two arrays read as flat vectors, in float32."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  unit = lambda x: jnp.where(jnp.linalg.norm(x) > eps, x / jnp.linalg.norm(x), x)
  cos = jnp.sum(unit(a) * unit(b))
  omega = jnp.arccos(jnp.clip(cos, -1.0, 1.0))
  spherical = (jnp.sin((1 - t) * omega) * a + jnp.sin(t * omega) * b) / jnp.sin(omega)
  return jnp.where(jnp.abs(cos) > COLINEAR, (1 - t) * a + t * b, spherical)


@settings.declare(t=settings.number(0.5, '[0, 1]', 'how far from θ0 toward the fine-tuned '
                                    'model, along the great circle'))
def merge(task_vectors: Sequence[TaskVector], *, theta0, t: float) -> TaskVector:
  """τ_m = slerp(θ0, θ0 + τ_1; t) − θ0 of the one task vector."""
  check_compatible(task_vectors, 'slerp')
  common.check_one_model(task_vectors, 'slerp', ' (nuslerp takes two, multislerp any)')
  base = tree_lib.flatten(theta0)
  return common.merged(task_vectors, tree_lib.map_with_path(
      lambda path, d: interpolate(t, base[path], base[path] + d) - base[path],
      task_vectors[0].delta))
