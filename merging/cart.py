"""CART: centred arithmetic with rank truncation; the task vectors centred on their average, each
truncated to low rank, added back to the average.

Choi, Kim, Lee and Hong, "Revisiting Weight Averaging for Model Merging" (arXiv 2412.12153).
With τ̄ = (1/T) Σ_t τ_t and the centred vectors c_t = τ_t − τ̄ (θ_t − θ_avg),

  τ_m = τ̄ + λ Σ_t SVD_k(c_t),   k = ⌊ρ · min(rows, cols)⌋,

where SVD_k keeps a matrix's k largest singular triplets. As the authors' code does, only the
attention and MLP weight matrices are truncated (leaves whose path holds 'attn' or 'mlp' and
that `ops.matrices` reads as a matrix); every other leaf is τ̄ exactly, since Σ_t c_t = 0. The
merge is applied as it is (θ0 + τ_m, the authors' λ = `prior` inside it), at their defaults
for ViT-B/32 over 8 tasks, ρ = 0.12 and λ = 2; k = 0 (a matrix too small for ρ) leaves it at
τ̄, as their ⌊·⌋ does. SVD_k may be found by a sketch (`svd='randomized'`, `merging.svd`)
instead of the full SVD.
"""

from typing import Sequence

import jax.numpy as jnp

from editing import settings
from editing import tree as tree_lib
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import svd as svd_lib


def truncated(matrix: jnp.ndarray, rank: int, svd: str) -> jnp.ndarray:
  """The matrix's best rank-`rank` approximation, U_k Σ_k V_kᵀ."""
  u, s, vt = svd_lib.top(matrix, rank, svd)
  return (u * s) @ vt


def is_truncated(path: str) -> bool:
  """Whether a matrix leaf is one CART truncates: an attention or MLP weight."""
  return ('attn' in path or 'mlp' in path) and not path.endswith(('bias', 'scale'))


@settings.declare(
    rank_ratio=settings.number(0.12, '(0, 1]', 'ρ: the share of a matrix\'s rank kept of each '
                               'centred vector'),
    prior=settings.number(2.0, '[0, inf)', 'λ: the scale of the truncated centred vectors'),
    svd=svd_lib.SETTING)
def merge(task_vectors: Sequence[TaskVector], *, rank_ratio: float, prior: float,
          svd: str) -> TaskVector:
  """The CART merge τ_m, applied as θ0 + τ_m."""
  check_compatible(task_vectors, 'cart')
  deltas = [tree_lib.flatten(v.delta) for v in task_vectors]
  merged = {}
  for path, view in ops.matrices(task_vectors[0].delta).items():
    leaves = [jnp.asarray(d[path], jnp.float32) for d in deltas]
    mean = sum(leaves) / len(leaves)
    if view is None or not is_truncated(path):
      merged[path] = mean
      continue
    centre = view.of(mean)
    rank = int(rank_ratio * min(centre.shape))
    moved = sum(truncated(view.of(x) - centre, rank, svd) for x in leaves)
    merged[path] = mean + prior * view.back(moved, mean.shape)
  return common.merged(task_vectors, tree_lib.unflatten(merged))
