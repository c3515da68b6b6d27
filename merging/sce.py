"""SCE: select the entries that vary most across the task vectors, calculate each vector's
weight from its energy, erase the minority signs, and merge.

Wan et al., "FuseChat: Knowledge Fusion of Chat Models", 2024, as mergekit's `sce` method
implements it, per tensor:

  select:    keep the ⌊k·n'⌋ entries of largest variance across the T vectors (n' of them have
             a non-zero variance; k = `select_topk`, 1 keeps all),
  calculate: w_t = mean_j τ_t[j]² / Σ_s mean_j τ_s[j]² (1/T where that sum is below 1e-6),
  erase:     a_t[j] = [sgn τ_t[j] = sgn Σ_s τ_s[j]] (a zero sum elects +, a zero entry agrees
             with none),
  τ_m[j] = Σ_t a_t[j] w_t τ_t[j] / max(Σ_t a_t[j] w_t, 1e-6).

Ties in variance go to the earlier entry (mergekit's torch.topk leaves them unspecified).
mergekit gives SCE no per-model weights. λ is chosen on validation.

A streamed merge selects from the same variances, computed on the host a block at a time
(`variance`: an entry's bits do not depend on the block that holds it), ranks them with the
one ranking engine, sums each vector's energy over the selection in a pass, then merges block
by block (`selection`, `streamed_sums`).
"""

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import settings
from editing import tree as tree_lib
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import sparsity


def variance(theta0, deltas: Sequence[np.ndarray], row=None) -> np.ndarray:
  """Each entry's variance across the T float32 deltas (the population's, as mergekit's
  torch.var(unbiased=False)), in float32 on the host, each entry's from its own T values in a
  fixed order: the same bits whole or a block at a time (`sparsity.Scores`)."""
  del theta0, row  # an entry's variance reads its deltas alone
  count = np.float32(len(deltas))
  mean = functools.reduce(np.add, deltas) / count
  total, term = np.zeros_like(mean), np.empty_like(mean)
  for d in deltas:  # in place: a block's temporaries stay in the cache
    np.square(np.subtract(d, mean, out=term), out=term)
    total += term
  return np.divide(total, count, out=total)


def kept_count(nonzero: int, select_topk: float) -> int:
  """⌊k·n'⌋, in float32 as mergekit's tensors compute it."""
  return int(np.floor(np.float32(nonzero) * np.float32(select_topk)))


def selection(select_topk: float) -> sparsity.Scores | None:
  """What SCE keeps of a tensor (`merging.Method.scores`): the ⌊k·n'⌋ largest variances; None
  where k keeps every entry."""
  if select_topk >= 1:
    return None
  return sparsity.Scores(variance, kept=functools.partial(kept_count, select_topk=select_topk))


def energies(deltas: Sequence[jax.Array]) -> jax.Array:
  """Σ_j τ_t[j]² of each vector (of what the selection kept)."""
  return jnp.stack([jnp.sum(jnp.square(d)) for d in deltas])


def streamed_sums(**_):
  """What a streamed merge sums over a tensor's blocks before it merges them
  (`merging.Method.sums`): each vector's energy, over the entries selected."""
  return lambda theta0, deltas: energies(deltas)


def merge_leaf(deltas: Sequence[jax.Array], select_topk: float, selected=None,
               totals: jax.Array | None = None, entries=None) -> jax.Array:
  """τ_m of one leaf's T deltas; `selected`, `totals` and `entries`: the selection's mask, the
  energies over it and the leaf's entry count, where a streamed merge found them for its
  whole tensor beforehand. Entry by entry over the T arrays, not over their stack: XLA's CPU
  reductions across a stack's leading axis are an order of magnitude slower."""
  deltas = [jnp.asarray(d, jnp.float32) for d in deltas]
  shape = deltas[0].shape
  if selected is None and select_topk < 1:
    if isinstance(deltas[0], jax.core.Tracer):
      variances = jnp.var(jnp.stack(deltas), axis=0).ravel()
      count = jnp.floor(jnp.count_nonzero(variances) * select_topk).astype(jnp.int32)
      selected = jnp.argsort(jnp.argsort(-variances, stable=True)) < count
    else:  # ranked on the host by `editing.cuts`, as a streamed merge ranks them
      variances = variance(None, [np.asarray(d, np.float32).ravel() for d in deltas])
      count = kept_count(np.count_nonzero(variances), select_topk)
      selected = tree_lib.top_k(variances, lambda n: count, 'tensor')
  if selected is not None:
    deltas = [jnp.where(jnp.reshape(selected, shape), d, 0.0) for d in deltas]
  energy = (jnp.stack([jnp.mean(jnp.square(d)) for d in deltas]) if totals is None
            else totals / entries)
  total = energy.sum()
  weights = jnp.where(total < 1e-6, 1.0 / len(deltas), energy / jnp.where(total < 1e-6, 1.0,
                                                                            total))
  sign = ops.elect_sign(deltas)
  erased = [jnp.where((jnp.sign(d) == sign) & (d != 0), weights[t], 0.0)
            for t, d in enumerate(deltas)]
  return sum(d * e for d, e in zip(deltas, erased)) / jnp.maximum(sum(erased), 1e-6)


@settings.declare(
    select_topk=settings.number(1.0, '(0, 1]', 'the share of entries of largest variance '
                                'across the vectors kept, k'))
def merge(task_vectors: Sequence[TaskVector], *, select_topk: float, selected: dict | None = None,
          totals: dict | None = None, entries: dict | None = None) -> TaskVector:
  """The SCE merge τ_m of the task vectors (before λ); `selected`, `totals` and `entries`,
  each leaf's selection, energies and entry count, where found beforehand (a streamed
  block's, of its whole tensor)."""
  check_compatible(task_vectors, 'sce')
  found = lambda found_of, path: None if found_of is None else found_of[path]
  return common.merged(task_vectors, tree_lib.map_with_path(
      lambda path, *ds: merge_leaf(ds, select_topk, found(selected, path), found(totals, path),
                                   found(entries, path)),
      *[v.delta for v in task_vectors]))
