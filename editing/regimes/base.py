"""The interface every fine-tuning regime implements."""

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from editing import tree as tree_lib

PyTree = Any
ApplyFn = Callable[[PyTree, Any], Any]  # apply_fn(params, images) -> embeddings
Encoder = Callable[[PyTree, PyTree, Any], Any]  # encoder(theta0, params, images) -> embeddings
LogitsFn = Callable[[PyTree, Any], Any]  # logits_fn(params, images) -> class logits


@dataclasses.dataclass(frozen=True)
class Regime:
  """A regime that trains the leaves matching `trainable_patterns` through the model itself.

  Attributes:
    name: the config key and the regime recorded in task vectors.
    trainable_patterns: regexes over '/'-joined leaf paths; every leaf when empty.
  """

  name: str
  trainable_patterns: tuple[str, ...] = ()

  def trainable(self, params: PyTree) -> dict[str, bool]:
    if not self.trainable_patterns:
      return {path: True for path in tree_lib.flatten(params)}
    return tree_lib.select(params, self.trainable_patterns)

  def encoder(self, apply_fn: ApplyFn) -> Encoder:
    """f(x; θ): the model itself; θ0 is not read."""
    return lambda theta0, params, images: apply_fn(params, images)

  def update_mask(self, params: PyTree, *, logits_fn: LogitsFn, images: np.ndarray,
                  key: jax.Array) -> dict[str, np.ndarray] | None:
    """Elementwise masks {path: bool array} on the trainable leaves' updates, fitted on
    calibration `images` before fine-tuning; None for a dense regime (the default)."""
    del params, logits_fn, images, key
    return None
