"""Frozen classification heads: the offline analogue of CLIP's zero-shot text heads.

A head is a (num_classes, embed_dim) matrix of unit class directions fitted on θ0: the mean
μ_c of the L2-normalised pretrained embeddings of class c on the task's training split, minus
the mean of those class means, normalised,

  w_c = (μ_c − mean_c' μ_c') / ‖μ_c − mean_c' μ_c'‖.

Logits are cosine similarities times a fixed scale, as in CLIP (``logit_scale · ⟨f̂(x), w_c⟩``).
Centring matters: the raw class means of one task are nearly parallel (cosine ≈ 0.99 on the
suite), so their logits would barely differ and fine-tuning through them would stall; the
centred directions keep the nearest-mean ranking up to a per-class scale and spread the logits.
Heads are never trained, so task vectors cover the backbone only.

A head may carry zero rows, which are no class: their logit is −∞. Fine-tuning pads every task's
head so (`padded`), so that tasks of any number of classes share one compiled step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from editing import settings
from editing.errors import UserError

# config.head: the frozen heads' logits.
SETTINGS = dict(logit_scale=settings.number(30.0, '(0, inf)', 'the cosine logits\' scale'))


def _normalize(x, axis=-1):
  return x / jnp.maximum(jnp.linalg.norm(x, axis=axis, keepdims=True), 1e-12)


def fit_prototypes(features: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
  """Unit-norm centred class means of unit-norm features; an error if a class has no example."""
  features = np.asarray(_normalize(jnp.asarray(features, jnp.float32)))
  counts = np.bincount(labels, minlength=num_classes)
  if (counts == 0).any():
    raise UserError(f'classes {np.flatnonzero(counts == 0).tolist()} have no training example')
  sums = np.zeros((num_classes, features.shape[-1]), np.float32)
  np.add.at(sums, labels, features)
  means = sums / counts[:, None]
  return np.asarray(_normalize(jnp.asarray(means - means.mean(axis=0))))


# Fine-tuning pads heads to a multiple of this many classes.
CLASS_MULTIPLE = 16


def logits(features: jax.Array, head: jax.Array, logit_scale: float) -> jax.Array:
  """logit_scale · cos(f(x), w_c) for every class c (rows of `head` need not be unit norm);
  −∞ for a zero row (padding)."""
  scores = logit_scale * _normalize(features.astype(jnp.float32)) @ _normalize(head).T
  return jnp.where(jnp.any(head != 0, axis=-1), scores, -jnp.inf)


def padded(head: jax.Array, multiple: int = CLASS_MULTIPLE) -> jax.Array:
  """`head` with zero rows appended up to a multiple of `multiple` classes: the same
  predictions and cross-entropy, in a shape that tasks of other class counts share."""
  rows = -len(head) % multiple
  return jnp.concatenate([jnp.asarray(head), jnp.zeros((rows,) + head.shape[1:], head.dtype)])


def logits_fn(encoder, theta0, head: jax.Array, logit_scale: float):
  """logits_fn(params, images): a regime's encoder (around θ0) read by a frozen head.

  The one classifier every job builds: fine-tuning's loss, the evaluator, TaLoS's calibration
  and the data-driven merges all score params through it.
  """
  return lambda params, images: logits(encoder(theta0, params, images), head, logit_scale)


def cross_entropy_loss(logits_of):
  """A loss for `editing.train.train` from logits_of(params, consts, images) -> logits.

  Returns loss_fn(params, consts, images, labels, rng) -> (mean cross-entropy, {'accuracy'}).
  """

  def loss_fn(params, consts, images, labels, rng):
    del rng
    scores = logits_of(params, consts, images)
    loss = optax.softmax_cross_entropy_with_integer_labels(scores, labels).mean()
    return loss, {'accuracy': jnp.mean(jnp.argmax(scores, -1) == labels)}

  return loss_fn


def multilabel_loss(logits_of):
  """A loss for `editing.train.train` from logits_of(params, consts, images) -> (batch, words)
  logits, against multi-hot targets: the mean of a sigmoid cross-entropy per word.

  Returns loss_fn(params, consts, images, targets, rng) -> (loss, {'word_accuracy'}).
  """

  def loss_fn(params, consts, images, targets, rng):
    del rng
    scores = logits_of(params, consts, images)
    targets = targets.astype(jnp.float32)
    loss = optax.sigmoid_binary_cross_entropy(scores, targets).mean()
    return loss, {'word_accuracy': jnp.mean((scores > 0) == (targets > 0))}

  return loss_fn


def frozen_head_loss(encoder, logit_scale: float):
  """The fine-tuning loss of every regime: cross-entropy of a frozen head on encoder features,
  reading θ0 and the head from consts = {'theta0': ..., 'head': ...}."""
  return cross_entropy_loss(lambda params, consts, images: logits_fn(
      encoder, consts['theta0'], consts['head'], logit_scale)(params, images))
