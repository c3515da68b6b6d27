"""RegMean: merge every linear layer in closed form from its tasks' input Gram matrices.

Jin et al., "Dataless Knowledge Fusion by Merging Weights of Language Models", ICLR 2023. For a
linear layer y = x W with task t's inputs X_t (rows: every token of every example) and weights W_t,
the W minimising Σ_t ‖X_t W − X_t W_t‖² is

  W_m = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_t,   G_t = X_tᵀ X_t,   G̃_t = α G_t + (1 − α) diag(G_t),

where shrinking the off-diagonal by α (default 0.9) regularises towards plain averaging (α = 0
is the mean of the W_t). Each task's Grams are taken on its own fine-tuned model θ0 + τ_t. The
linear layers are every Dense/DenseGeneral the model calls (multi-axis kernels are flattened
to 2-D); every other leaf (biases, LayerNorms, embeddings) is averaged. As a task vector,
τ_m = θ_m − θ0, applied at λ = 1.

Linearized (and L-LoRA) task vectors are refused: their model is not a stack of linear layers
in θ.
"""

import functools
import math
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from editing import batching
from editing import distributed
from editing import regimes
from editing import settings
from editing import tree as tree_lib
from editing.errors import UserError
from editing.task_vector import TaskVector, check_compatible
from merging import common

ApplyFn = Callable[[Any, jax.Array], Any]  # the plain model: apply_fn(params, images)


def gram_matrices(apply_fn: ApplyFn, params: common.PyTree, images: np.ndarray,
                  batch_size: int = 64) -> dict[str, np.ndarray]:
  """{kernel path: Σ xᵀx over the inputs x of that linear layer}, for every Dense layer."""
  grams_of_batch = _grams_of_batch(apply_fn)
  totals: dict[str, np.ndarray] = {}
  for batch in batching.padded_batches([images], batch_size):
    for path, gram in distributed.to_host(grams_of_batch(params, *batch.arrays,
                                                    batch.weights)).items():
      totals[path] = totals.get(path, 0.0) + gram.astype(np.float64)
  return totals


@functools.lru_cache(maxsize=8)
def _grams_of_batch(apply_fn: ApplyFn):
  """The jitted Grams of one batch, one per model: RegMean++ takes them on a new params tree
  for every block and task, and those trees share one compile."""

  def grams_of_batch(params, images, weights):
    grams = {}
    with nn.intercept_methods(capture_grams(weights, grams)):
      apply_fn(params, images)
    return grams

  return jax.jit(grams_of_batch)


def capture_grams(weights: jax.Array, grams: dict):
  """A flax interceptor (`nn.intercept_methods`) that puts Σ w xᵀx over the inputs x of each
  Dense call into grams[its kernel path], `weights` weighing each example (batch,) or each
  token (batch, tokens)."""
  def capture(next_fun, args, kwargs, context):
    if _is_linear_call(context):
      path = '/'.join(context.module.path + ('kernel',))
      x = args[0].reshape(args[0].shape[0], -1, _fan_in(context.module, args[0].shape))
      w = weights if weights.ndim == 2 else weights[:, None]
      grams[path] = jnp.einsum('bn,bni,bnj->ij', jnp.broadcast_to(w, x.shape[:2]), x, x)
    return next_fun(*args, **kwargs)

  return capture


def _is_linear_call(context) -> bool:
  return isinstance(context.module, (nn.Dense, nn.DenseGeneral)) and \
      context.method_name == '__call__'


def linear_layers(apply_fn: ApplyFn, params: common.PyTree, images: np.ndarray) -> list[str]:
  """The kernel paths of the Dense layers `apply_fn` calls, in the order it first calls them."""
  order: list[str] = []

  def record(next_fun, args, kwargs, context):
    if _is_linear_call(context):
      order.append('/'.join(context.module.path + ('kernel',)))
    return next_fun(*args, **kwargs)

  # A new function each call: jax caches the trace of a function it has seen, and a cached
  # trace would not call `record`.
  with nn.intercept_methods(record):
    jax.eval_shape(lambda p, x: apply_fn(p, x), params, images)
  return list(dict.fromkeys(order))


def _fan_in(module: nn.Module, input_shape) -> int:
  """The size of the input axes a Dense layer contracts, the trailing ones: read from the
  layer, since shapes alone cannot tell a kernel (heads, head_dim, out) contracting both
  leading axes from one contracting the first where heads = head_dim."""
  axis = getattr(module, 'axis', -1)
  axes = sorted(a % len(input_shape) for a in ((axis,) if isinstance(axis, int) else axis))
  if axes != list(range(len(input_shape) - len(axes), len(input_shape))):
    raise ValueError(f'{module.path}: contracts axes {axis} of its inputs {input_shape}, not '
                     'the trailing ones')
  return math.prod(input_shape[a] for a in axes)


def solve(weights: Sequence[jax.Array], grams: Sequence[jax.Array], alpha: float) -> jax.Array:
  """W_m = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_t for one layer: its tasks' kernels and input Grams."""
  fan_in = grams[0].shape[0]
  shrunk = [alpha * g + (1 - alpha) * jnp.diag(jnp.diag(g)) for g in
            (jnp.asarray(g, jnp.float32) for g in grams)]
  matrices = [w.reshape(fan_in, -1) for w in weights]
  solved = jnp.linalg.solve(sum(shrunk), sum(g @ w for g, w in zip(shrunk, matrices)))
  return solved.reshape(weights[0].shape)


def combine(task_vectors: Sequence[TaskVector], theta0: common.PyTree,
            grams: Sequence[Mapping[str, np.ndarray]], alpha: float = 0.9) -> TaskVector:
  """The RegMean vector from each task's Grams (same keys for every task); jit-able."""
  check_compatible(task_vectors, 'regmean')
  check_alpha(alpha, 'regmean')
  flat0 = tree_lib.flatten(theta0)
  deltas = [tree_lib.flatten(v.delta) for v in task_vectors]
  merged = {}
  for path, w0 in flat0.items():
    if path in grams[0]:
      solved = solve([w0 + d[path] for d in deltas], [g[path] for g in grams], alpha)
      merged[path] = solved - w0
    else:
      merged[path] = sum(d[path] for d in deltas) / len(deltas)
  return common.merged(task_vectors, tree_lib.unflatten(merged))


def check_alpha(alpha: float, method: str) -> None:
  if not 0 <= alpha <= 1:
    raise UserError(f'{method} alpha must be in [0, 1], got {alpha}')


def check_layered(task_vectors: Sequence[TaskVector], method: str) -> None:
  """Refuses the vectors of a model that is not a stack of linear layers in θ."""
  check_compatible(task_vectors, method)
  if task_vectors[0].regime in regimes.TANGENT:
    raise UserError(f'{method} merges layer by layer through the model itself; '
                    f'{task_vectors[0].regime} task vectors act through the tangent model, which '
                    'has no such layers')


@settings.declare(
    alpha=settings.number(0.9, '[0, 1]', 'the share of each Gram\'s off-diagonal kept'),
    batch_size=settings.integer(64, '[1, inf)', 'examples per Gram batch'))
def merge(task_vectors: Sequence[TaskVector], *, theta0: common.PyTree, apply_fn: ApplyFn,
          data: Mapping[str, common.TaskData], alpha: float, batch_size: int) -> TaskVector:
  """RegMean, with each task's Grams taken on its fine-tuned model over its `data` images."""
  check_layered(task_vectors, 'regmean')
  grams = [gram_matrices(apply_fn, v.apply_to(theta0), common.task_of(v, data, 'regmean').images,
                         batch_size) for v in task_vectors]
  return combine(task_vectors, theta0, grams, alpha)
