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
fold_in(fold_in(key, stable_hash(task)), stable_hash(path)), and each entry from that key folded
with its index in the leaf's rows (`ops.kept_entries`), whatever the order of the vectors or
leaves, so a streamed merge draws a block of rows as the whole leaf would.
"""

from typing import Any, Mapping, Sequence

import jax

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import sparsity as sparsity_lib


def sparsity(density: float, epsilon: float, rescale: str, **_) -> sparsity_lib.Sparsity:
  """MagPrune as a draw whose keep probabilities spread over each row's ranks; none at d = 1."""
  return sparsity_lib.Sparsity(draw=sparsity_lib.Draw(1 - density, rescale, epsilon))


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
          per_vector: Mapping[str, Sequence] | None = None,
          dropped: Sequence[Any] | None = None) -> TaskVector:
  """The DELLA merge τ_m of the task vectors (before λ); `per_vector` may give each vector its
  own density and epsilon (mergekit's per-model parameters); `dropped`, each vector's deltas
  after MagPrune drawn beforehand (a streamed block's, whose ranks are its rows' and whose L1
  norms are its whole tensor's)."""
  check_compatible(task_vectors, 'della')
  if weights is not None:
    common.check_weights(weights, len(task_vectors), 'della')
  own = common.per_vector(per_vector, {'density': density, 'epsilon': epsilon},
                          len(task_vectors), merge, 'della')
  if dropped is None:
    dropped = [ops.drop_and_rescale(v.delta, 1 - s['density'], ops.vector_key(key, v.tasks),
                                    rescale, s['epsilon']) for v, s in zip(task_vectors, own)]
  return common.merged(task_vectors, ops.combine(list(dropped), weights, elect_sign, normalize))
