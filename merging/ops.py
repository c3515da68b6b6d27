"""The primitives merges are built from: trim, elect a sign, take the disjoint mean, drop and
rescale; and for the SVD-era merges, each layer read as a matrix and the polar factor. Each maps
deltas (params-shaped pytrees) to deltas, is jit-able, and keeps no state.
Their arguments are the methods' settings, checked where each method declares them."""

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import lora
from editing import tree as tree_lib
from merging import sparsity
from merging import svd

PyTree = Any
SCOPES = tree_lib.SCOPES


def keep_largest(delta: PyTree, density: float, scope: str = 'global') -> PyTree:
  """Boolean masks of the top-`density` magnitudes: max(1, ⌊density·n⌋) entries, exactly
  (`sparsity.largest`).

  scope='tensor' keeps that share of every leaf on its own (as mergekit does); scope='global'
  ranks the whole tree at once (as the TIES paper and FusionBench do). Ties go to the earlier
  entry (path order, then row-major), so the count is exact.
  """
  return sparsity.kept(delta, sparsity.largest(density, scope))


def keep_band(delta: PyTree, top: float, bottom: float) -> PyTree:
  """Per-leaf masks dropping the ⌊top·n⌋ largest and the ⌊bottom·n⌋ smallest magnitudes
  (`sparsity.band`)."""
  return sparsity.kept(delta, sparsity.band(top, bottom))


def where(mask: PyTree, delta: PyTree) -> PyTree:
  """m ⊙ τ."""
  return jax.tree.map(lambda m, d: jnp.where(m, d, jnp.zeros_like(d)), mask, delta)


def elect_sign(deltas: Sequence[PyTree]) -> PyTree:
  """γ = sgn(Σ_t τ_t) per entry, with a zero sum elected +1 (as mergekit does)."""
  return jax.tree.map(lambda *ds: jnp.where(sum(ds) >= 0, 1.0, -1.0).astype(ds[0].dtype),
                      *deltas)


def disjoint_mean(deltas: Sequence[PyTree], sign: PyTree,
                  weights: Sequence[float] | None = None, normalize: bool = True) -> PyTree:
  """Per entry, Σ_t m_t τ_t / Σ_t m_t w_t over the non-zero τ_t whose sign is γ (m_t), 0 where
  none is: the mean of the agreeing entries for unit weights, mergekit's weighted disjoint mean
  for weighted deltas τ_t = w_t·δ_t; without `normalize`, the sum Σ_t m_t τ_t."""
  weights = [1.0] * len(deltas) if weights is None else list(weights)

  def mean(s, *ds):
    agree = [(jnp.sign(d) == s) & (d != 0) for d in ds]
    total = sum(jnp.where(a, d, 0.0) for a, d in zip(agree, ds))
    if not normalize:
      return total
    count = sum(a.astype(total.dtype) * w for a, w in zip(agree, weights))
    return total / jnp.where(count == 0, 1.0, count)

  return jax.tree.map(mean, sign, *deltas)


def combine(deltas: Sequence[PyTree], weights: Sequence[float] | None = None,
            elect: bool = True, normalize: bool = True) -> PyTree:
  """mergekit's generalized task arithmetic of sparsified deltas δ_t: weighted, w_t·δ_t; then,
  if `elect`, the disjoint mean of the weighted deltas (TIES' sign election), else their sum,
  divided by Σ_t w_t if `normalize`."""
  weights = [1.0] * len(deltas) if weights is None else list(weights)
  weighted = [jax.tree.map(lambda x, w=w: w * x, d) for d, w in zip(deltas, weights)]
  if elect:
    return disjoint_mean(weighted, elect_sign(weighted), weights, normalize)
  total = jax.tree.map(lambda *xs: sum(xs), *weighted)
  return jax.tree.map(lambda x: x / sum(weights), total) if normalize else total


# How a sparsified delta is rescaled: by 1/(1 − p), the inverse keep probability of each entry
# (DARE's and DELLA's papers), or to the tensor's own L1 norm, ‖δ‖₁/‖m ⊙ δ‖₁ (mergekit).
RESCALES = ('probability', 'l1_norm')


def l1_factor(before: jax.Array, after: jax.Array, eps: float = 1e-7) -> jax.Array:
  """‖δ‖₁/‖m ⊙ δ‖₁ from the two norms, or 1 where either is below `eps` (mergekit's
  `rescaled_masked_tensor`)."""
  small = (before < eps) | (after < eps)
  return jnp.where(small, 1.0, before / jnp.where(small, 1.0, after))


def rescale_l1(delta: jax.Array, masked: jax.Array, eps: float = 1e-7) -> jax.Array:
  """m ⊙ δ scaled to δ's L1 norm, left as it is where either norm is below `eps`."""
  return masked * l1_factor(jnp.abs(delta).sum(), jnp.abs(masked).sum(), eps)


def vector_key(key: jax.Array, tasks: Sequence[str]) -> jax.Array:
  """The key of the task vector of `tasks`, from which each of its leaves draws (`leaf_key`):
  fold_in(key, stable_hash(','.join(tasks))), whatever the order of the vectors."""
  return jax.random.fold_in(key, tree_lib.stable_hash(','.join(tasks)))


def leaf_key(key: jax.Array, path: str) -> jax.Array:
  """The key a leaf's draws come from: fold_in(key, stable_hash(path)), whatever the order of
  the leaves."""
  return jax.random.fold_in(key, tree_lib.stable_hash(path))


@functools.partial(jax.jit, static_argnames='size')
def kept_entries(key: jax.Array, q: Any, start: Any, size: int) -> jax.Array:
  """The flat keep mask of entries [start, start + size) of the leaf whose key is `key`
  (`start` may be traced; a leaf holds fewer than 2^32 entries): entry i is kept if
  u_i < q (q one probability, or one per entry), u_i the uniform that the first word w of
  fold_in(key, i) makes, (w >> 9)·2^-23, as jax.random.uniform makes it. Entry i's draw is its
  own, so any run of entries (a block of a streamed tensor) draws the bits the leaf drawn whole
  would, on any device count."""
  index = jnp.asarray(start, jnp.uint32) + jnp.arange(size, dtype=jnp.uint32)
  words = jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(key, index))[:, 0]
  return (words >> 9).astype(jnp.float32) * 2.0**-23 < q


def spread_table(n: int, q: float, spread: float) -> np.ndarray:
  """MagPrune's keep probability q − ε + 2ε·r/(n − 1) of ascending magnitude rank r = 0..n−1
  in a row of n, so the row keeps a share q on average, its large entries more often than its
  small ones. Made on the host and looked up, so that no compiler contracts it into a fused
  multiply-add in one program and not in another: a streamed block's q are the whole leaf's."""
  step = 2 * spread / (n - 1) if n > 1 else 0.0
  return ((q - spread) + np.arange(n) * step).astype(np.float32)


def rank_spread(row_magnitudes: jax.Array, q: float, spread: float) -> jax.Array:
  """Each entry's `spread_table` probability, by its rank in its row (the last axis; ties in
  magnitude to the earlier entry)."""
  n = row_magnitudes.shape[-1]
  ranks = jnp.argsort(jnp.argsort(row_magnitudes, axis=-1, stable=True), axis=-1)
  return jnp.asarray(spread_table(n, q, spread))[ranks]


def host_rank_spread(row_magnitudes: np.ndarray, q: float, spread: float) -> np.ndarray:
  """`rank_spread` of float32 magnitudes on the host, for a streamed block: one sort per row of
  keys that hold each magnitude's bits (ordered as the magnitudes are) then its index, unique,
  so their order is the stable one; an XLA sort on a CPU takes about 15 times as long."""
  count, n = row_magnitudes.shape
  keys = row_magnitudes.view(np.uint32).astype(np.uint64) << np.uint64(32)
  keys |= np.arange(n, dtype=np.uint64)
  keys.sort(axis=-1)
  ranks = np.empty((count, n), np.intp)
  np.put_along_axis(ranks, (keys & np.uint64(0xFFFFFFFF)).astype(np.intp),
                    np.broadcast_to(np.arange(n), (count, n)), axis=-1)
  return spread_table(n, q, spread)[ranks]


def dropped(delta: jax.Array, keep: jax.Array, q: Any, rescale: str,
            factor: jax.Array | None = None) -> jax.Array:
  """m ⊙ δ / q (q the keep probability, one or one per entry), or with rescale 'l1_norm'
  m ⊙ δ · ‖δ‖₁/‖m ⊙ δ‖₁; `factor`, if given, that ratio found beforehand (a streamed block's,
  of its whole tensor)."""
  if rescale == 'l1_norm':
    masked = jnp.where(keep, delta, jnp.zeros_like(delta))
    return rescale_l1(delta, masked) if factor is None else masked * factor
  return jnp.where(keep, delta / q, jnp.zeros_like(delta))


def drop_and_rescale(delta: PyTree, p: float, key: jax.Array,
                     rescale: str = 'probability', spread: float = 0.0) -> PyTree:
  """τ̃ = (1 − m) ⊙ τ / (1 − p), m ~ Bernoulli(p) per entry (DARE); with rescale='l1_norm',
  (1 − m) ⊙ τ scaled to τ's L1 norm per leaf instead. With a `spread` ε, each entry's keep
  probability is MagPrune's q_r of its magnitude's rank in its row (`rank_spread`, the rows of
  `rows`; DELLA), and a kept entry is divided by its own q_r.

  Each leaf draws from leaf_key(key, path), an entry at a time (`kept_entries`, in the order
  of its rows), so the result does not depend on the traversal order, the device count, the
  sharding or the blocks a streamed merge reads; p = 0 returns τ unchanged.
  """
  if p == 0:
    return delta
  views = matrices(delta) if spread else {}

  def drop(path, d):
    if not spread:
      keep = kept_entries(leaf_key(key, path), 1 - p, 0, d.size).reshape(d.shape)
      return dropped(d, keep, 1 - p, rescale)
    r = rows(views[path], d)
    q = rank_spread(jnp.abs(r), 1 - p, spread)
    keep = kept_entries(leaf_key(key, path), q.ravel(), 0, d.size).reshape(r.shape)
    return from_rows(views[path], dropped(r, keep, q, rescale), d.shape)

  return tree_lib.map_with_path(drop, delta)


class Matrix(NamedTuple):
  """How a leaf reads as a matrix W of (outputs, inputs), as PyTorch stores a Linear's weight:
  a flax kernel (its input axes, then its output axes) is flattened to (inputs, outputs) and
  transposed; any other 2-D leaf (a PyTorch weight, an embedding table) is read as it is."""

  inputs: int
  outputs: int
  transposed: bool

  def of(self, x: jax.Array) -> jax.Array:
    return x.reshape(self.inputs, self.outputs).T if self.transposed else x

  def back(self, w: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return (w.T if self.transposed else w).reshape(shape)


def matrices(delta: PyTree) -> dict[str, Matrix | None]:
  """{path: its matrix view, or None}: the leaves the SVD-era merges treat as linear layers.

  Dense and attention kernels (2-D and 3-D flax kernels, read as LoRA reads them:
  `lora.matrix_shape`) and other 2-D leaves are matrices; convolutions, biases (an attention
  bias is 2-D here, 1-D in PyTorch), norms and vectors are not (the methods average them), as
  in FusionBench, whose PyTorch tensors are 2-D exactly there. A kernel's shape cannot say
  which of its axes are outputs (a query kernel (in, heads, dim) and an output one (heads,
  dim, out) are both 3-D), and a bias is not always there to say it, so the layer's name does.
  """
  return {path: matrix_view(path, np.shape(x)) for path, x in tree_lib.flatten(delta).items()}


def matrix_view(path: str, shape: tuple[int, ...]) -> Matrix | None:
  """The matrix view `matrices` gives the leaf at `path` of `shape`, or None."""
  if path.endswith('kernel') and len(shape) in (2, 3):
    return Matrix(*lora.matrix_shape(path, shape), True)
  if len(shape) == 2 and not path.endswith(('kernel', 'bias', 'scale')):
    return Matrix(shape[1], shape[0], False)
  return None


def row_length(path: str, shape: tuple[int, ...]) -> int | None:
  """The length of a leaf's `rows` where each is a run of entries in the order it is stored
  (None where its matrix view is a transpose: a flax kernel)."""
  view = matrix_view(path, shape)
  if view is not None:
    return None if view.transposed else view.inputs
  return math.prod(shape[1:]) if len(shape) > 1 else math.prod(shape)


def rows(view: Matrix | None, x: jax.Array) -> jax.Array:
  """x read as rows: its matrix's (outputs, inputs) where `matrices` reads it as one, else
  along its first axis (a vector is one row)."""
  return view.of(x) if view is not None else x.reshape(x.shape[0] if x.ndim > 1 else 1, -1)


def from_rows(view: Matrix | None, r: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The leaf of `shape` whose `rows` are `r`."""
  return view.back(r, shape) if view is not None else r.reshape(shape)


def per_matrix(task_vectors: Sequence[Any], merge_matrix: Callable[[list], jax.Array]) -> PyTree:
  """The merged deltas: merge_matrix([W_1..W_T]) of each matrix leaf (as `matrices` reads it),
  the mean of the τ_t elsewhere.

  Every merge_matrix here (TSV-M, Iso-C, Iso-CTS, WUDI) makes zero of zero matrices, so a layer
  that no task changed (every tensor but the adapted ones of a LoRA fine-tune merged as a
  checkpoint) is not taken through its SVDs or steps where the arrays are concrete."""
  deltas = [tree_lib.flatten(v.delta) for v in task_vectors]
  merged = {}
  for path, view in matrices(task_vectors[0].delta).items():
    leaves = [jnp.asarray(d[path], jnp.float32) for d in deltas]
    if view is None:
      merged[path] = sum(leaves) / len(leaves)
    elif _unchanged(leaves):
      merged[path] = jnp.zeros_like(leaves[0])
    else:
      merged[path] = view.back(merge_matrix([view.of(x) for x in leaves]), leaves[0].shape)
  return tree_lib.unflatten(merged)


def _unchanged(leaves: list) -> bool:
  return (not any(isinstance(x, jax.core.Tracer) for x in leaves)
          and not any(bool(jnp.any(x != 0)) for x in leaves))


def polar(a: jax.Array) -> jax.Array:
  """The orthogonal factor PQᵀ of A = PΣQᵀ: the nearest matrix with orthonormal columns."""
  p, _, qt = svd.thin(a)
  return p @ qt
