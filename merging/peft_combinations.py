"""PEFT's combinations of LoRA adapters (`LoraModel.add_weighted_adapter`), on LoRA task vectors.

Each adapter t brings, per adapted kernel, B_t A_t with its scale s_t and a weight w_t; the
result is an adapter of scale 1 (PEFT sets the new lora_alpha to the new rank):

- cat: A = [w_1 s_1 A_1; …; w_T s_T A_T], B = [B_1 … B_T]: exactly Σ_t w_t s_t B_t A_t, of rank
  Σ_t r_t.
- linear, ties, dare_linear, dare_ties, magnitude_prune (equal ranks): A and B are combined
  apart, by `op`, with weights sgn(w_t s_t)·√|w_t s_t| on the A_t and √|w_t s_t| on the B_t.
  The product of the two sums holds cross terms B_t A_u, so even `linear` is not Σ_t w_t s_t B_t A_t.
- svd and the `_svd` types: the dense ΔW_t = s_t B_t A_t are combined by `op` with weights w_t,
  then cut to rank `svd_rank` (default: the largest r_t) by an SVD, B = U_r Σ_r, A = V_rᵀ, and
  with `svd_clamp` both clipped at that quantile of their entries.

The ops (PEFT's utils/merge_utils.py) act on stacked tensors x_t:

  linear            Σ_t w_t x_t
  magnitude_prune   Σ_t w_t · top(x_t)           top: the ⌊density·n⌋ largest |x_t[j]| kept
  ties              Σ_t m_t w_t top(x_t) / max(1, Σ_t m_t)
  dare_linear       Σ_t w_t · drop(x_t)          drop: kept with probability density, ÷ density
  dare_ties         as ties, with drop for top

where m_t marks the entries whose sign is the majority's, sgn Σ_t top(x_t) ('total', the
unweighted pruned sum, a zero sum counting as +) or the sign of Σ_t sgn top(x_t)
('frequency'). A density of 1 prunes nothing and does not rescale. PEFT draws DARE's masks from
torch's global generator; here they come from the merge's key.
"""

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from editing import settings
from editing.errors import UserError
from editing.lora import LowRank
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import svd

COMBINATIONS = ('cat', 'linear', 'svd', 'ties', 'ties_svd', 'dare_linear', 'dare_ties',
                'dare_linear_svd', 'dare_ties_svd', 'magnitude_prune', 'magnitude_prune_svd')


def magnitude_pruned(x: jax.Array, density: float) -> jax.Array:
  """x with all but its ⌊density·n⌋ largest magnitudes zeroed (ties to the earlier entry)."""
  if density >= 1:
    return x
  kept = int(density * x.size)
  mask = jnp.zeros(x.size, bool)
  if kept:
    mask = mask.at[jax.lax.top_k(jnp.abs(x).ravel(), kept)[1]].set(True)
  return jnp.where(mask.reshape(x.shape), x, 0)


def randomly_pruned(x: jax.Array, density: float, key: jax.Array) -> jax.Array:
  """x with each entry kept with probability `density` and divided by it."""
  if density >= 1:
    return x
  return jnp.where(jax.random.bernoulli(key, density, x.shape), x / density, 0)


def combined(tensors: Sequence[jax.Array], weights: Sequence[float], op: str, *, density: float,
             majority_sign_method: str, key: jax.Array) -> jax.Array:
  """PEFT's `op` over the stacked `tensors` with `weights` (the module docstring's table)."""
  weights = jnp.asarray(weights, jnp.float32).reshape((-1,) + (1,) * tensors[0].ndim)
  if op == 'linear':
    return jnp.sum(weights * jnp.stack(tensors), axis=0)
  if op.startswith('dare'):
    keys = jax.random.split(key, len(tensors))
    pruned = jnp.stack([randomly_pruned(x, density, k) for x, k in zip(tensors, keys)])
  else:
    pruned = jnp.stack([magnitude_pruned(x, density) for x in tensors])
  if op in ('magnitude_prune', 'dare_linear'):
    return jnp.sum(weights * pruned, axis=0)
  votes = jnp.sign(pruned) if majority_sign_method == 'frequency' else pruned
  majority = jnp.where(jnp.sum(votes, axis=0) >= 0, 1.0, -1.0)
  agree = jnp.sign(pruned) == majority
  return jnp.sum(weights * pruned * agree, axis=0) / jnp.maximum(jnp.sum(agree, axis=0), 1)


def _factor_merge(factors: list[LowRank], weights, combination, *, density, majority_sign_method,
                  svd_rank, svd_clamp, key, path) -> LowRank:
  ws = [w * f.scale for w, f in zip(weights, factors)]
  shape = factors[0].shape
  one = jnp.ones((), jnp.float32)
  if combination == 'cat':
    return LowRank(jnp.concatenate([f.b for f in factors], axis=1),
                   jnp.concatenate([w * f.a for w, f in zip(ws, factors)], axis=0), one, shape)
  op_settings = dict(density=density, majority_sign_method=majority_sign_method)
  if not combination.endswith('svd'):
    ranks = sorted({f.rank for f in factors})
    if len(ranks) > 1:
      raise UserError(f'peft_{combination}: {path} has adapters of ranks {ranks}; '
                      f'{combination} combines A and B entry by entry and needs equal ranks '
                      '(cat and the svd types take any)')
    key_a, key_b = jax.random.split(key)
    roots = [jnp.sqrt(jnp.abs(w)) for w in ws]
    a = combined([f.a for f in factors], [jnp.sign(w) * r for w, r in zip(ws, roots)],
                 combination, key=key_a, **op_settings)
    b = combined([f.b for f in factors], roots, combination, key=key_b, **op_settings)
    return LowRank(b, a, one, shape)
  op = 'linear' if combination == 'svd' else combination[:-len('_svd')]
  delta = combined([f.matrix() for f in factors], weights, op, key=key, **op_settings)
  rank = svd_rank or max(f.rank for f in factors)
  if rank > min(delta.shape):
    raise UserError(f'peft_{combination}: svd_rank {rank} exceeds the {delta.shape} ΔW of {path}')
  u, s, vt = svd.thin(delta)
  b, a = u[:, :rank] * s[:rank], vt[:rank]
  if svd_clamp is not None:
    high = jnp.quantile(jnp.concatenate([b.ravel(), a.ravel()]), svd_clamp)
    b, a = jnp.clip(b, -high, high), jnp.clip(a, -high, high)
  return LowRank(b, a, one, shape)


@settings.declare(
    density=settings.number(0.2, '(0, 1]', 'the share kept by the pruning types (PEFT\'s docs\' '
                            'example)'),
    majority_sign_method=settings.choice('total', ('total', 'frequency'), 'how the TIES types '
                                         'elect the sign: the sum, or the count of signs'),
    svd_rank=settings.integer(None, '[1, inf)', 'the rank of the svd types\' result (None: the '
                              'largest rank merged)'),
    svd_clamp=settings.number(None, '(0, 1)', 'the quantile at which the svd types clip their '
                              'factors (None: no clip)'))
def merge(task_vectors: Sequence[TaskVector], *, combination: str, key: jax.Array, density: float,
          majority_sign_method: str, svd_rank: int | None, svd_clamp: float | None,
          weights: Sequence[float] | None = None) -> TaskVector:
  """The LoRA vector PEFT's `combination` of the vectors' adapters makes (before λ)."""
  check_compatible(task_vectors, f'peft_{combination}')
  if combination not in COMBINATIONS:
    raise ValueError(f'unknown PEFT combination {combination!r}; known: {COMBINATIONS}')
  if not task_vectors[0].low_rank:
    raise UserError(f'peft_{combination} combines LoRA adapters; these task vectors '
                    f'({task_vectors[0].regime}) are dense')
  weights = list(weights) if weights is not None else [1.0] * len(task_vectors)
  common.check_weights(weights, len(task_vectors), f'peft_{combination}')
  delta = {path: _factor_merge(
      [v.delta[path] for v in task_vectors], weights, combination, density=density,
      majority_sign_method=majority_sign_method, svd_rank=svd_rank, svd_clamp=svd_clamp,
      key=ops.leaf_key(key, path), path=path)
      for path in task_vectors[0].delta}
  return common.merged(task_vectors, delta)


def of(combination: str):
  """`merge` bound to one combination type."""
  return functools.partial(merge, combination=combination)

