"""The interface every fine-tuning regime implements."""

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from editing import tree as tree_lib
from editing.task_vector import TaskVector

PyTree = Any
ApplyFn = Callable[[PyTree, Any], Any]  # apply_fn(params, images) -> embeddings
Encoder = Callable[[PyTree, PyTree, Any], Any]  # encoder(theta0, params, images) -> embeddings
LogitsFn = Callable[[PyTree, Any], Any]  # logits_fn(params, images) -> class logits


@dataclasses.dataclass(frozen=True)
class Regime:
  """A regime that trains the leaves matching `trainable_patterns` through the model itself.

  What trains may be θ0's own leaves (the default) or other parameters of the model's weights
  (LoRA's factors): `initial` gives them, `weights` maps them to the model's params, and
  `task_vector` takes the difference fine-tuning made.

  Attributes:
    name: the config key and the regime recorded in task vectors.
    trainable_patterns: regexes over '/'-joined leaf paths; every leaf when empty.
  """

  name: str
  trainable_patterns: tuple[str, ...] = ()

  def trainable(self, params: PyTree) -> dict[str, bool]:
    """{path: whether it trains} over `initial`'s tree."""
    if not self.trainable_patterns:
      return {path: True for path in tree_lib.flatten(params)}
    return tree_lib.select(params, self.trainable_patterns)

  def initial(self, theta0: PyTree, key: jax.Array) -> PyTree:
    """What fine-tuning trains, as it starts: θ0 itself."""
    del key
    return theta0

  def weights(self, theta0: PyTree, params: PyTree) -> PyTree:
    """The model's params given the trained `params`: those themselves."""
    del theta0
    return params

  def task_vector(self, theta0: PyTree, trained: PyTree, *, task: str) -> TaskVector:
    """τ = θ_ft − θ0."""
    return TaskVector.from_params(theta0, trained, task=task, regime=self.name)

  def encoder(self, apply_fn: ApplyFn) -> Encoder:
    """f(x; θ): the model itself; θ0 is not read."""
    return lambda theta0, params, images: apply_fn(params, images)

  def training_encoder(self, apply_fn: ApplyFn) -> Encoder:
    """The encoder as a function of what trains (`initial`'s tree)."""
    encoder = self.encoder(apply_fn)
    return lambda theta0, params, images: encoder(theta0, self.weights(theta0, params), images)

  def update_mask(self, params: PyTree, *, logits_fn: LogitsFn, images: np.ndarray,
                  key: jax.Array) -> dict[str, np.ndarray] | None:
    """Elementwise masks {path: bool array} on the trainable leaves' updates, fitted on
    calibration `images` before fine-tuning; None for a dense regime (the default)."""
    del params, logits_fn, images, key
    return None
