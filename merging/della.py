"""DELLA: drop entries at random with probabilities set by their magnitude's rank (MagPrune),
rescale the kept ones, then merge with TIES' sign election or linearly.

Deep et al., "DELLA-Merging: Reducing Interference in Model Merging through Magnitude-Based
Sampling", 2024. Within each row of a layer (the row of its (outputs, inputs) matrix; a vector
is one row), the entry of ascending magnitude rank r of n is kept with probability

  p_r = (d − ε) + 2ε · (r − 1)/(n − 1),

so the row keeps a share d on average, its large entries more often than its small ones. The
kept entries are rescaled by 1/p_r (the paper; `rescale='probability'`) or to the tensor's L1
norm (mergekit; `rescale='l1_norm'`). Then τ_m combines the weighted deltas as mergekit's
generalized task arithmetic does (`ops.combine`): `elect_sign` is mergekit's `della`,
without it `della_linear`. d = 1 keeps every entry (mergekit's default density); λ is chosen
on validation.

Draws are keyed as DARE's: task t's leaf at `path` from
fold_in(fold_in(key, stable_hash(task)), stable_hash(path)), whatever the order of the vectors
or leaves.
"""

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp

from editing import settings
from editing import tree as tree_lib
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops


def keep_probabilities(row_magnitudes: jax.Array, density: float, epsilon: float) -> jax.Array:
  """p_r of each entry of each row (the last axis), ties in magnitude to the earlier entry."""
  n = row_magnitudes.shape[-1]
  ranks = jnp.argsort(jnp.argsort(row_magnitudes, axis=-1, stable=True), axis=-1)
  spread = ranks / (n - 1) if n > 1 else jnp.zeros(row_magnitudes.shape)
  return (density - epsilon) + 2 * epsilon * spread


def magprune(delta: dict, density: float, epsilon: float, rescale: str,
             key: jax.Array) -> dict:
  """One vector's deltas after MagPrune and the rescale (a flat {path: leaf} tree)."""
  if density == 1:
    return delta
  views = ops.matrices(delta)

  def prune(path, d):
    rows = ops.rows(views[path], d)
    p = keep_probabilities(jnp.abs(rows), density, epsilon)
    kept = jax.random.bernoulli(ops.leaf_key(key, path), p)
    if rescale == 'l1_norm':
      out = ops.rescale_l1(rows, jnp.where(kept, rows, 0.0))
    else:
      out = jnp.where(kept, rows / p, 0.0)
    return ops.from_rows(views[path], out, d.shape)

  return {path: prune(path, d) for path, d in delta.items()}


@settings.declare(
    density=settings.number(1.0, '(0, 1]', "the share of each row's entries kept on average, d"),
    epsilon=settings.number(0.15, '[0, 1)', 'the spread of the keep probabilities, ε'),
    rescale=settings.choice('probability', ops.RESCALES, "the kept entries' rescale: by 1/p "
                            "(the paper) or to each tensor's L1 norm (mergekit)"),
    elect_sign=settings.flag(True, "TIES' sign election (mergekit's della); else a weighted "
                             'sum (della_linear)'),
    normalize=settings.flag(True, 'divide by the (agreeing) weights; else a sum'),
    constraint=settings.Constraint(
        lambda s: s['density'] == 1 or 0 < s['density'] - s['epsilon'] and
        s['density'] + s['epsilon'] < 1,
        'density ± epsilon must lie in (0, 1), so that every keep probability does'))
def merge(task_vectors: Sequence[TaskVector], *, key: jax.Array, density: float,
          epsilon: float, rescale: str, elect_sign: bool, normalize: bool,
          weights: Sequence[float] | None = None,
          per_vector: Mapping[str, Sequence] | None = None) -> TaskVector:
  """The DELLA merge τ_m of the task vectors (before λ); `per_vector` may give each vector its
  own density and epsilon (mergekit's per-model parameters)."""
  check_compatible(task_vectors, 'della')
  if weights is not None:
    common.check_weights(weights, len(task_vectors), 'della')
  own = common.per_vector(per_vector, {'density': density, 'epsilon': epsilon},
                          len(task_vectors), merge, 'della')
  pruned = []
  for v, settings_t in zip(task_vectors, own):
    flat = magprune(tree_lib.flatten(v.delta), settings_t['density'], settings_t['epsilon'],
                    rescale, ops.vector_key(key, v.tasks))
    pruned.append(tree_lib.unflatten(flat))
  return common.merged(task_vectors, ops.combine(pruned, weights, elect_sign, normalize))
