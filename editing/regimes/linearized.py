"""NTK-linearized fine-tuning: train the first-order Taylor model of the encoder around θ0.

Ortiz-Jimenez et al., "Task Arithmetic in the Tangent Space", NeurIPS 2023:

  f_lin(x; θ) = f(x; θ0) + J_θ f(x; θ0) (θ − θ0),

computed with one `jax.jvp` at the fixed θ0 (never re-linearized during training) over the whole
encoder, embeddings and LayerNorms included; the frozen head sits outside. Linear task vectors,
and their sums and merges, are evaluated through the same f_lin, which the evaluator does by
using this regime's encoder.
"""

import dataclasses

import jax
import jax.numpy as jnp

from editing.regimes.base import ApplyFn, Encoder, Regime


@dataclasses.dataclass(frozen=True)
class Linearized(Regime):
  """Every encoder leaf trains, through f_lin instead of f."""

  def encoder(self, apply_fn: ApplyFn) -> Encoder:
    def linearized(theta0, params, images):
      tangent = jax.tree.map(jnp.subtract, params, theta0)
      out, dout = jax.jvp(lambda p: apply_fn(p, images), (theta0,), (tangent,))
      return out + dout

    return linearized


LINEARIZED = Linearized('linearized')
