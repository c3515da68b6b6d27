"""How far an edit leaves the linear range: f(θ0 + α τ) against its first-order prediction.

For a regime's encoder f (features of images, or a decoder's next-token logits) at θ0 and a
task vector τ, the first-order prediction of the edited model is

  f(θ0 + α τ) ≈ f(θ0) + α · J τ,   J τ = d/dε f(θ0 + ε τ) at ε = 0   (one jvp),

and the departure from it at α, over a batch of inputs X (Frobenius norms), is

  d(α) = ‖f(θ0 + α τ) − f(θ0) − α J τ‖ / ‖α J τ‖.

d = 0 where the edit acts as its linearisation does, the regime in which task vectors add
without interfering (Ortiz-Jimenez et al., NeurIPS 2023, who fine-tune in the tangent space to
get there: the linearized regime's f is its own first-order model, and its d is 0 up to
rounding). Read on other tasks' inputs, d(α) says whether adding τ at α to another task's
model stays in the range where the sum of the tasks' effects is the effect of the sum.
"""

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing.regimes.base import Encoder
from editing.task_vector import TaskVector

PyTree = Any


def departures(encoder: Encoder, theta0: PyTree, vector: TaskVector, inputs: np.ndarray,
               alphas: Sequence[float], batch_size: int = 256) -> list[float]:
  """d(α) for each α of `alphas` (each > 0), over `inputs`, in batches of `batch_size`."""
  delta = jax.tree.map(lambda d, w: jnp.asarray(d, jnp.asarray(w).dtype),
                       vector.materialized(theta0).delta, theta0)
  residuals = np.zeros(len(alphas))
  predicted = np.zeros(len(alphas))
  for start in range(0, len(inputs), batch_size):
    x = jnp.asarray(inputs[start:start + batch_size])
    base, tangent, edited = _program(encoder)(theta0, delta, x, jnp.asarray(alphas, jnp.float32))
    for i, alpha in enumerate(alphas):
      residuals[i] += float(jnp.sum(jnp.square(edited[i] - base - alpha * tangent)))
      predicted[i] += float(jnp.sum(jnp.square(alpha * tangent)))
  return [float(np.sqrt(r / p)) if p > 0 else 0.0 for r, p in zip(residuals, predicted)]


@functools.lru_cache(maxsize=8)
def _program(encoder: Encoder):
  """jit(θ0, τ, x, alphas) -> (f(θ0), J τ, [f(θ0 + α τ) for α]), in float32."""

  def run(theta0, delta, x, alphas):
    f = lambda params: encoder(theta0, params, x).astype(jnp.float32)
    base, tangent = jax.jvp(f, (theta0,), (delta,))
    edited = jax.lax.map(
        lambda a: f(jax.tree.map(lambda w, d: w + (a * d).astype(w.dtype), theta0, delta)),
        alphas)
    return base, tangent, edited

  return jax.jit(run)
