"""Sums of squared per-example gradients, Σ_i (∂ g(θ; x_i) / ∂θ)², the diagonal-Fisher estimate
that TaLoS's sensitivity scores and Fisher merging both rest on."""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from editing import batching
from editing import distributed
from editing import tree as tree_lib

PyTree = Any
# example_fn(params, image, extra, shared) -> scalar, for one example (image without batch axis)
ExampleFn = Callable[[PyTree, jax.Array, jax.Array, Any], jax.Array]


class SquaredGradientSum:
  """Σ_i (∂ example_fn(θ, x_i, e_i, c) / ∂θ_j)² for the leaves of θ at `paths`.

  Per-example gradients come from `jax.vmap` over fixed-size chunks of `batch_size` examples
  (`editing.batching`: the last one padded and its padding weighted 0), compiled once for
  every call; `e_i` is a per-example extra (a label, an index) and `c` a value shared by all
  (e.g. a PRNG key). The other leaves enter as constants and are not differentiated.
  """

  def __init__(self, example_fn: ExampleFn, params: PyTree, paths: list[str], batch_size: int):
    flat = tree_lib.flatten(params)
    self._scored = {p: flat[p] for p in paths}
    self._rest = {p: v for p, v in flat.items() if p not in self._scored}
    self._batch_size = batch_size

    def of_scored(scored, rest, image, extra, shared):
      return example_fn(tree_lib.unflatten({**scored, **rest}), image, extra, shared)

    def chunk_sum(scored, rest, images, extras, weights, shared):
      grads = jax.vmap(jax.grad(of_scored), in_axes=(None, None, 0, 0, None))(
          scored, rest, images, extras, shared)
      return jax.tree.map(lambda g: jnp.tensordot(weights, jnp.square(g), axes=1), grads)

    self._chunk_sum = jax.jit(chunk_sum)

  def __call__(self, images: np.ndarray, extras: np.ndarray, shared=None,
               params: PyTree | None = None) -> dict[str, np.ndarray]:
    """The sums at the construction's params, or at `params` (the same tree and shapes: the
    compiled program serves both)."""
    scored, rest = self._scored, self._rest
    if params is not None:
      flat = tree_lib.flatten(params)
      scored, rest = {p: flat[p] for p in scored}, {p: flat[p] for p in rest}
    totals = {p: np.zeros(np.shape(v), np.float32) for p, v in scored.items()}
    for batch in batching.padded_batches([images, extras], self._batch_size):
      sums = self._chunk_sum(scored, rest, *batch.arrays, batch.weights, shared)
      for p, s in distributed.to_host(sums).items():
        totals[p] += s
    return totals
