"""Localize-and-Stitch: each task's vector kept on a small region it localizes, the regions
stitched into one model.

He et al., "Localize-and-Stitch: Efficient Model Merging via Sparse Task Arithmetic", TMLR 2025.
Localization gives task t a binary mask m_t; stitching averages the tasks where their regions
overlap:

  τ_m = Σ_t γ_t ⊙ τ_t,   γ_t = m_t / Σ_s m_s   (0 where no task keeps the entry),

applied at λ = 1: a single model, no task identity at inference.

  localize_stitch           m_t learned on task t's labeled training examples: real scores S,
                            initialised to +b on the top `sparsity` share of |τ_t| (global) and
                            −b elsewhere, then `epochs` full-batch steps on
                              L_t(θ0 + σ(S) ⊙ τ_t) + l1 · Σ σ(S),
                            S ← S − lr · (∇_θ L_t ⊙ τ_t) · σ'(S) − l1 · σ'(S);  m_t = round(σ(S))
  dataless_localize_stitch  m_t the top `sparsity` share of |τ_t| (global), no data

Defaults are the authors' vision script's: b = 5, lr = 1e7, l1 = 1, 10 epochs, initial share
1e-5; the dataless share 0.1. Two departures from their code, which METHODS.md lists as
suspected bugs: ∇L is the mean over the examples (their loop sums the batches' means, so its
step grows with the number of batches), and the L1 step shrinks σ(S), the paper's objective
(their update has the opposite sign, which sharpens S away from 0). Every leaf is localized
(the authors leave the CLIP text tower's tables and projections out; our models have none).
"""

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import sparsity as sparsity_lib


def stitch(task_vectors: Sequence[TaskVector], masks: Sequence[common.PyTree]) -> TaskVector:
  """τ_m = Σ_t γ_t ⊙ τ_t, γ_t = m_t / Σ_s m_s (0 where Σ_s m_s = 0)."""
  check_compatible(task_vectors, 'localize_stitch')

  def stitched(*pairs):
    deltas, kept = pairs[:len(pairs) // 2], pairs[len(pairs) // 2:]
    count = sum(k.astype(jnp.float32) for k in kept)
    total = sum(jnp.where(k, d, 0.0) for d, k in zip(deltas, kept))
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)

  return common.merged(task_vectors, jax.tree.map(
      stitched, *[v.delta for v in task_vectors], *masks))


def dataless_sparsity(*, sparsity: float, **_) -> sparsity_lib.Sparsity:
  """What the dataless merge keeps of a vector: its top `sparsity` magnitudes, over the vector
  (a streamed merge ranks them in passes of its own, and passes the masks as `keep`)."""
  return sparsity_lib.Sparsity(cut=sparsity_lib.largest(sparsity, 'global'))


@settings.declare(sparsity=settings.number(0.1, '(0, 1]', 'the share of |τ_t| each mask keeps'))
def merge_dataless(task_vectors: Sequence[TaskVector], *, sparsity: float,
                   keep: Sequence[common.PyTree] | None = None) -> TaskVector:
  """Dataless Localize-and-Stitch: each mask the top `sparsity` of |τ_t|, over the vector
  (or `keep`, the masks already ranked)."""
  if keep is None:
    keep = [ops.keep_largest(v.delta, sparsity, 'global') for v in task_vectors]
  return stitch(task_vectors, keep)


def localize(logits_fn: common.LogitsFn, theta0: common.PyTree, vector: TaskVector,
             images: np.ndarray, labels: np.ndarray, *, sparsity: float, sigmoid_bias: float,
             lr: float, l1: float, epochs: int, batch_size: int) -> common.PyTree:
  """Task t's binary mask, learned as the module docstring says."""
  tau = vector.delta
  start = ops.keep_largest(tau, sparsity, 'global')
  scores = jax.tree.map(lambda k: jnp.where(k, sigmoid_bias, -sigmoid_bias), start)
  gradient = _mean_gradient(logits_fn)
  for _ in range(epochs):
    gates = jax.tree.map(jax.nn.sigmoid, scores)
    params = jax.tree.map(lambda w, g, d: w + g * d, theta0, gates, tau)
    total = jax.tree.map(jnp.zeros_like, params)
    for begin in range(0, len(images), batch_size):
      x, y = images[begin:begin + batch_size], labels[begin:begin + batch_size]
      total = jax.tree.map(lambda a, b, n=len(y): a + n * b, total, gradient(params, x, y))
    mean = jax.tree.map(lambda g: g / len(images), total)
    scores = jax.tree.map(
        lambda s, g, d, gate: s - (lr * g * d + l1) * gate * (1 - gate), scores, mean, tau,
        gates)
  return jax.tree.map(lambda s: jax.nn.sigmoid(s) > 0.5, scores)


def _mean_gradient(logits_fn: common.LogitsFn):
  """jit(params, x, y) -> ∇ of the mean cross-entropy of a batch."""

  def loss(params, x, y):
    log_p = jax.nn.log_softmax(logits_fn(params, x).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=-1))

  return jax.jit(jax.grad(loss))


@settings.declare(
    sparsity=settings.number(1e-5, '(0, 1]', 'the share of |τ_t| a mask starts from'),
    sigmoid_bias=settings.number(5.0, '(0, inf)', 'the scores\' starting magnitude b'),
    lr=settings.number(1e7, '(0, inf)', 'the step on the scores'),
    l1=settings.number(1.0, '[0, inf)', 'the weight of the masks\' L1 norm'),
    epochs=settings.integer(10, '[1, inf)', 'full-batch steps'),
    batch_size=settings.integer(128, '[1, inf)', 'examples per gradient batch'))
def merge(task_vectors: Sequence[TaskVector], *, theta0: common.PyTree,
          data: Mapping[str, common.TaskData], **values) -> TaskVector:
  """Localize-and-Stitch: each mask learned on its task's labeled `data`."""
  check_compatible(task_vectors, 'localize_stitch')
  masks = []
  for vector in task_vectors:
    task = common.labeled_task_of(vector, data, 'localize_stitch')
    masks.append(localize(task.logits_fn, theta0, vector, task.images, task.labels, **values))
  return stitch(task_vectors, masks)
