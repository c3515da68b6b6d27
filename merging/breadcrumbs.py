"""Model Breadcrumbs: drop the largest and the smallest magnitudes of every layer of every task
vector, then task arithmetic.

Davari & Belilovsky, "Model Breadcrumbs: Scaling Multi-Task Model Merging with Sparse Masks",
ECCV 2024:

  τ_m = Σ_t m_t ⊙ τ_t,   m_t keeps, per leaf, the magnitudes between the ⌊bottom·n⌋ smallest
  and the ⌊top·n⌋ largest.

The largest entries are outliers whose sum interferes across tasks; the smallest are noise.
Defaults keep 10% of each leaf after dropping its top 1% (`top=0.01`, `bottom=0.89`); λ is
chosen on validation.

mergekit's `breadcrumbs` and `breadcrumbs_ties` weight the masked deltas (`weights` w_t), and
the latter elects a sign as TIES does: τ_m = Σ_t a_t w_t m_t τ_t, with a_t[j] whether τ_t[j]
agrees with γ = sgn(Σ_t w_t m_t τ_t) (all ones without `elect_sign`), divided by Σ_t a_t w_t
if `normalize`. Its (density d, gamma γ) are density = d, top = γ, bottom = 0 here: a leaf
keeps its ⌊d·n⌋ largest after its ⌊γ·n⌋ largest, the ⌊bottom·n⌋ form rounding its lower edge
differently by an entry or two. Where d + γ > 1, fewer of the largest are dropped, as
mergekit does.
"""

from typing import Any, Sequence

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import sparsity as sparsity_lib


def sparsity(*, top: float, bottom: float, density: float | None = None,
             **_) -> sparsity_lib.Sparsity:
  """What Breadcrumbs keeps of one vector: per leaf, the magnitudes between its ⌊bottom·n⌋
  smallest and its ⌊top·n⌋ largest; with `density`, its ⌊density·n⌋ largest after the
  ⌊top·n⌋ largest (mergekit's count)."""
  if density is not None:
    return sparsity_lib.Sparsity(cut=sparsity_lib.outliers(density, top))
  return sparsity_lib.Sparsity(cut=sparsity_lib.band(top, bottom))


@settings.declare(
    top=settings.number(0.01, '[0, 1)', 'the share of each leaf\'s largest magnitudes dropped'),
    bottom=settings.number(0.89, '[0, 1)', 'the share of its smallest magnitudes dropped'),
    density=settings.number(None, '(0, 1]', "the share kept below the top's, counted as "
                            "mergekit counts it; in place of bottom, which must then be 0"),
    elect_sign=settings.flag(False, 'keep only the entries that agree with the elected sign '
                             "(mergekit's breadcrumbs_ties)"),
    normalize=settings.flag(False, 'divide by the (agreeing) weights; else a sum'),
    constraint=settings.Constraint(
        lambda s: s['top'] + s['bottom'] < 1 and (s['density'] is None or s['bottom'] == 0),
        'top + bottom must be < 1 (something must be kept), and bottom 0 where density is '
        'given (density sets the lower edge)'))
def merge(task_vectors: Sequence[TaskVector], *, top: float, bottom: float,
          density: float | None, elect_sign: bool, normalize: bool,
          weights: Sequence[float] | None = None,
          keep: Sequence[Any] | None = None) -> TaskVector:
  """Σ_t of each vector with its per-leaf magnitude tails dropped; `keep`, if given, holds the
  band masks already ranked (a streamed merge ranks each tensor on the host first)."""
  check_compatible(task_vectors, 'breadcrumbs')
  if keep is None:
    cut = sparsity(top=top, bottom=bottom, density=density).cut
    keep = [sparsity_lib.kept(v.delta, cut) for v in task_vectors]
  if weights is not None:
    common.check_weights(weights, len(task_vectors), 'breadcrumbs')
  masked = [ops.where(k, v.delta) for k, v in zip(keep, task_vectors)]
  return common.merged(task_vectors, ops.combine(masked, weights, elect_sign, normalize))
