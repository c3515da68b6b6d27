"""KnOTS: LoRA task vectors aligned by one joint SVD per kernel, then merged there.

Stoica et al., "Model merging with SVD to tie the KnOTS", ICLR 2025. Per adapted kernel, the
T dense deltas ΔW_t = s_t B_t A_t (outputs × inputs) are concatenated along their inputs and
decomposed in float64,

  [ΔW_1 … ΔW_T] = U Σ Vᵀ,   Vᵀ = [V_1ᵀ … V_Tᵀ],   so   ΔW_t = U Σ V_tᵀ,

keeping the singular values above 1e-5. Each task is then represented by R_t = Σ V_tᵀ (k ×
inputs) in the basis U that every task shares. The representations are merged with TIES
(`knots_ties`) — the top `density` of each task's magnitudes over all its kernels at once, the
elected sign γ = sgn Σ_t R̂_t (a zero sum takes the sign of the sum over every entry, the
global majority), the mean of the agreeing non-zero entries — or with DARE then TIES' sign and
mean without trimming (`knots_dare`, the authors' DARE-TIES with topK 100). The merge is
ΔW = U R_m, kept as a LoRA vector of rank k ≤ Σ_t r_t (B = U, A = R_m, s = 1); λ is the
authors' scaling coefficient.

Defaults are the authors' ViT configs: density 0.2 (topK 20), DARE p = 0.1. Where their code
differs: its top 20% keeps ⌊0.2·n⌋ + 1 entries and this keeps max(1, ⌊0.2·n⌋) (TIES' count
everywhere here); it seeds DARE itself (421), this draws from the merge's key.
"""

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import settings
from editing.errors import UserError
from editing.lora import LowRank
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops

RANK_EPSILON = 1e-5


def aligned(task_vectors: Sequence[TaskVector]) -> tuple[dict[str, np.ndarray], list[dict]]:
  """({path: U}, per task {path: R_t = Σ V_tᵀ}) of the joint SVD of every adapted kernel."""
  basis, reps = {}, [{} for _ in task_vectors]
  for path in task_vectors[0].delta:
    deltas = [np.asarray(v.delta[path].matrix(), np.float64) for v in task_vectors]
    u, s, vt = np.linalg.svd(np.concatenate(deltas, axis=1), full_matrices=False)
    kept = s > RANK_EPSILON
    basis[path] = u[:, kept].astype(np.float32)
    blocks = np.split(s[kept, None] * vt[kept], len(deltas), axis=1)
    for rep, block in zip(reps, blocks):
      rep[path] = block.astype(np.float32)
  return basis, reps


def _elected_sign(trimmed: list[dict]) -> dict:
  totals = {p: sum(r[p] for r in trimmed) for p in trimmed[0]}
  majority = jnp.where(sum(jnp.sum(t) for t in totals.values()) >= 0, 1.0, -1.0)
  return {p: jnp.where(t > 0, 1.0, jnp.where(t < 0, -1.0, majority)) for p, t in totals.items()}


def _merged(task_vectors, reps, basis) -> TaskVector:
  mean = ops.disjoint_mean(reps, _elected_sign(reps))
  shapes = {p: d.shape for p, d in task_vectors[0].delta.items()}
  return common.merged(task_vectors, {
      p: LowRank(jnp.asarray(basis[p]), mean[p], jnp.ones((), jnp.float32), shapes[p])
      for p in basis})


def _checked(task_vectors, name):
  check_compatible(task_vectors, name)
  if not task_vectors[0].low_rank:
    raise UserError(f'{name} merges LoRA task vectors; these ({task_vectors[0].regime}) are '
                    'dense')


@settings.declare(
    density=settings.number(0.2, '(0, 1]', 'the share of each task\'s representation kept, '
                            'ranked over all its kernels (the authors\' topK 20)'))
def merge_ties(task_vectors: Sequence[TaskVector], *, density: float) -> TaskVector:
  """KnOTS-TIES (before λ)."""
  _checked(task_vectors, 'knots_ties')
  basis, reps = aligned(task_vectors)
  trimmed = [ops.where(ops.keep_largest(r, density, 'global'), r) for r in reps]
  return _merged(task_vectors, trimmed, basis)


@settings.declare(
    p=settings.number(0.1, '[0, 1)', 'the share of each representation\'s entries dropped, '
                      'the rest scaled by 1/(1 − p)'))
def merge_dare(task_vectors: Sequence[TaskVector], *, key: jax.Array, p: float) -> TaskVector:
  """KnOTS-DARE-TIES (before λ)."""
  _checked(task_vectors, 'knots_dare')
  basis, reps = aligned(task_vectors)
  dropped = [ops.drop_and_rescale(r, p, k)
             for r, k in zip(reps, jax.random.split(key, len(reps)))]
  return _merged(task_vectors, dropped, basis)
