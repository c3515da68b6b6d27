"""TIES-merging: trim, elect sign, disjoint merge; applied as θ0 + λ·τ_m.

Yadav et al., "TIES-Merging: Resolving Interference When Merging Models", NeurIPS 2023.

  τ̂_t = τ_t ⊙ top_k(|τ_t|),   γ = sgn(Σ_t τ̂_t),
  τ_m[j] = Σ_{t: sgn τ̂_t[j] = γ[j]} τ̂_t[j] / |{t: sgn τ̂_t[j] = γ[j], τ̂_t[j] ≠ 0}|.

`density` is the kept share of magnitudes, the paper's k (default 20%). `scope` decides what
"top k" ranks: 'global' (default) ranks each task vector as a whole, as the paper describes and
FusionBench implements; 'tensor' ranks every leaf on its own, as mergekit does. Ties in
magnitude go to the earlier entry; a zero sign sum elects +1 and the mean divides by the
agreeing non-zero entries (both as in mergekit). The paper's merge is a disjoint *mean*
(FusionBench defaults to a sum: `normalize=False`); λ is chosen on validation.

Per-vector `weights` w_t follow mergekit: the trimmed deltas are weighted before the sign
election, and the mean divides by the agreeing weights,
τ_m[j] = Σ_t m_t[j] w_t τ̂_t[j] / Σ_t m_t[j] w_t (unit weights give the mean above).
"""

from typing import Any, Mapping, Sequence

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import sparsity as sparsity_lib


def sparsity(*, density: float, scope: str, **_) -> sparsity_lib.Sparsity:
  """What TIES keeps of one vector: its max(1, ⌊density·n⌋) largest magnitudes, of each
  tensor or of the whole vector (`scope`)."""
  return sparsity_lib.Sparsity(cut=sparsity_lib.largest(density, scope))


def trim(task_vectors: Sequence[TaskVector], densities: Sequence[float], scope: str,
         keep: Sequence[Any] | None = None) -> list:
  """τ̂_t: each vector's deltas with all but its top-`densities[t]` magnitudes zeroed; `keep`,
  if given, holds those masks already ranked (a streamed merge ranks a tensor, or a whole
  model, in passes of its own, then merges a block at a time)."""
  if keep is None:
    keep = [sparsity_lib.kept(v.delta, sparsity(density=d, scope=scope).cut)
            for v, d in zip(task_vectors, densities)]
  return [ops.where(k, v.delta) for k, v in zip(keep, task_vectors)]


@settings.declare(
    density=settings.number(0.2, '(0, 1]', "the share of each vector's magnitudes kept, k"),
    scope=settings.choice('global', ops.SCOPES, "what top-k ranks: each vector whole "
                          "('global') or each of its tensors ('tensor')"),
    normalize=settings.flag(True, 'divide by the agreeing weights (a mean); else a sum'))
def merge(task_vectors: Sequence[TaskVector], *, density: float, scope: str, normalize: bool,
          weights: Sequence[float] | None = None, per_vector: Mapping[str, Sequence] | None = None,
          keep: Sequence[Any] | None = None) -> TaskVector:
  """The TIES merge τ_m of the task vectors (before λ); `per_vector` may give each vector its
  own density (mergekit's per-model density)."""
  check_compatible(task_vectors, 'ties')
  if weights is not None:
    common.check_weights(weights, len(task_vectors), 'ties')
  densities = [s['density'] for s in common.per_vector(per_vector, {'density': density},
                                                       len(task_vectors), merge, 'ties')]
  return common.merged(task_vectors, ops.combine(trim(task_vectors, densities, scope, keep),
                                                 weights, normalize=normalize))
