"""Model Stock: the fine-tuned models' mean pulled toward θ0 by the angle between their deltas.

Jang et al., "Model Stock: All we need is just a few fine-tuned models", ECCV 2024. Per leaf,
with c the mean pairwise cosine of the N task vectors (each pair's cosine with its norms'
product clamped at 1e-6 and the cosine at [−1, 1], as mergekit's model_stock.py),

  t = N·c / ((N − 1)·c + 1),   θ = t·mean_t θ_t + (1 − t)·θ0,   so τ_m = t · mean_t τ_t,

applied at λ = 1. mergekit averages the pairwise cosines (followed here); FusionBench averages
the pairwise angles in degrees. Neither guards c ≤ 0, where t turns negative and blows up at
c = −1/(N − 1); here c is clipped to [0, 1] (`clip`), so that deltas at right or wider
angles give θ0. mergekit's recipes run without the clip, as mergekit does.

`filter_wise` (mergekit's option) takes one t per filter instead of per leaf: each row of a
leaf along its last axis (a PyTorch-shaped weight's output unit, its inputs along the row)
has its own cosines, c_r = mean over pairs of cos(τ_i[r], τ_j[r]), and its own t_r; a vector
leaf is one row.
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from editing import settings
from editing import tree as tree_lib
from editing.errors import UserError
from editing.task_vector import TaskVector, check_compatible
from merging import common


def _rows(delta: jax.Array, filter_wise: bool) -> jax.Array:
  """The vectors whose angles set t, as the rows of a matrix: the whole leaf as one row, or
  each row along its last axis."""
  width = delta.shape[-1] if filter_wise and delta.ndim else delta.size
  return jnp.reshape(delta, (-1, width)).astype(jnp.float32)


def sums(deltas: Sequence[jax.Array], filter_wise: bool = False) -> jax.Array:
  """‖τ_i‖² of each delta, then τ_i·τ_j of each pair (i < j), in float32 (per row with
  `filter_wise`, on the last axis): sums over a leaf's entries, so a streamed merge adds them
  block by block and merges each block from the whole leaf's."""
  rows = [_rows(d, filter_wise) for d in deltas]
  n = len(rows)
  return jnp.stack([jnp.sum(r * r, axis=-1) for r in rows] +
                   [jnp.sum(rows[i] * rows[j], axis=-1)
                    for i in range(n) for j in range(i + 1, n)], axis=-1)


def streamed_sums(filter_wise: bool, **_):
  """What a streamed merge sums over a tensor's blocks before it merges them (`merging.Method`);
  per row (`filter_wise`), none: each tensor is merged whole."""
  return None if filter_wise else lambda theta0, deltas: sums(deltas)


def ratio(deltas: Sequence[jax.Array], clip: bool = True, filter_wise: bool = False,
          totals: jax.Array | None = None) -> jax.Array:
  """t of one leaf's N deltas: a scalar, or with `filter_wise` one per row, shaped to
  broadcast against the leaf; from their `sums` (`totals`, where found beforehand)."""
  n = len(deltas)
  found = sums(deltas, filter_wise) if totals is None else totals
  norms = [jnp.sqrt(found[..., i]) for i in range(n)]
  pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
  cosines = [jnp.clip(found[..., n + k] / jnp.maximum(norms[i] * norms[j], 1e-6), -1, 1)
             for k, (i, j) in enumerate(pairs)]
  c = sum(cosines) / len(cosines)
  if clip:
    c = jnp.clip(c, 0.0, 1.0)
  t = n * c / ((n - 1) * c + 1)
  if filter_wise and deltas[0].ndim > 1:
    return jnp.reshape(t, deltas[0].shape[:-1] + (1,))
  return t[0]  # one row: the leaf's


@settings.declare(clip=settings.flag(True, 'clip the mean cosine to [0, 1] (right or wider '
                                     'angles give θ0); mergekit does not'),
                  filter_wise=settings.flag(False, 'one t per row of a leaf (its last axis), '
                                            'as mergekit\'s filter_wise'))
def merge(task_vectors: Sequence[TaskVector], *, clip: bool, filter_wise: bool,
          totals: dict | None = None) -> TaskVector:
  """τ_m = t · mean τ_t per leaf (per row with `filter_wise`); `totals`, each leaf's `sums`
  found beforehand (a streamed block's, of its whole tensor)."""
  check_compatible(task_vectors, 'model_stock')
  if len(task_vectors) < 2:
    raise UserError(f'model_stock needs at least 2 task vectors (their angle sets the ratio), '
                    f'got {len(task_vectors)}')
  return common.merged(task_vectors, tree_lib.map_with_path(
      lambda path, *ds: ratio(ds, clip, filter_wise, None if totals is None else totals[path]) *
      sum(ds) / len(ds), *[v.delta for v in task_vectors]))
