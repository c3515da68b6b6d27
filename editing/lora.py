"""Low-rank factors of a task vector's matrices, and PEFT's names for them.

A LoRA delta of one kernel is kept as its factors (`LowRank`), PEFT's convention,

  ΔW = s · B A,   B (outputs × r),   A (r × inputs),   s = α / r  (rsLoRA: α / √r),

and read on our kernel, laid out (inputs, outputs), as ΔK = s · (B A)ᵀ. flax's DenseGeneral
keeps attention heads as axes of their own: a query, key or value kernel (in, heads, dim) is the
matrix (in, heads·dim), the output kernel (heads, dim, out) the matrix (heads·dim, out)
(`matrix_shape`).

A (outputs, inputs) delta ΔW = U Σ Vᵀ is cut to its r largest singular values,

  ΔW ≈ B A,   B = U_r Σ_r^½ (outputs × r),   A = Σ_r^½ V_rᵀ (r × inputs),

(`distribute_scale`; else B = U_r, A = Σ_r V_rᵀ), as mergekit-extract-lora factors. r is at
most `rank`, and fewer where `sv_epsilon` > 0 drops the singular values at or below it
(absolute, as mergekit's) or where `energy` < 1 keeps only the fewest that hold that share of
‖ΔW‖²_F = Σ σ_i². The share actually kept is reported with the factors.

PEFT stores a LoRA module's factors as `base_model.model.<module>.lora_A.weight` (r × inputs)
and `...lora_B.weight` (outputs × r), and a module saved whole (`modules_to_save`) as
`base_model.model.<module>.weight`; with lora_alpha = r its scale α/r is 1.
"""

import math
import re
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from editing import settings
from editing.errors import UserError

PREFIX = 'base_model.model.'
_HEADS_IN = re.compile(r'(^|/)attn/out/kernel$')


def matrix_shape(path: str, shape: tuple[int, ...]) -> tuple[int, int]:
  """(inputs, outputs) of the kernel at `path` read as a matrix."""
  if len(shape) == 2:
    return shape[0], shape[1]
  if len(shape) == 3:
    leading = 2 if _HEADS_IN.search(path) else 1
    return math.prod(shape[:leading]), math.prod(shape[leading:])
  raise UserError(f'{path}: LoRA adapts a 2-D kernel or an attention projection; this leaf is '
                  f'{len(shape)}-D {tuple(shape)}')


@flax.struct.dataclass
class LowRank:
  """One kernel's delta as LoRA factors, never multiplied out until `dense` is asked for.

  The one type for a pair of LoRA factors, as every pair has B, A and a scale s: a LoRA task
  vector's leaf, a PEFT adapter's module (s = α/r) and a truncated SVD's factors (s = 1) are
  each a LowRank, and the kernel's shape lets any of them be laid out as a kernel (`dense`).

  Attributes:
    b: B, (outputs, r).
    a: A, (r, inputs).
    scale: s, a 0-d array: c·ΔW scales it and leaves the factors bit for bit.
    shape: the kernel's shape.
  """

  b: jax.Array
  a: jax.Array
  scale: jax.Array
  shape: tuple[int, ...] = flax.struct.field(pytree_node=False)

  @property
  def rank(self) -> int:
    return self.a.shape[0]

  def matrix(self) -> jax.Array:
    """ΔW = s · B A, (outputs, inputs) as PyTorch lays a weight, float32."""
    return self.scale * (jnp.asarray(self.b, jnp.float32) @ jnp.asarray(self.a, jnp.float32))

  def dense(self) -> jax.Array:
    """ΔK = s · (B A)ᵀ, in the kernel's shape, float32."""
    return self.matrix().T.reshape(self.shape)

  def scaled(self, c) -> 'LowRank':
    return self.replace(scale=c * self.scale)

  def __add__(self, other: 'LowRank') -> 'LowRank':
    """s₁B₁A₁ + s₂B₂A₂ = [s₁B₁ s₂B₂] [A₁; A₂]: exact, of rank r₁ + r₂, with s = 1."""
    return LowRank(jnp.concatenate([self.scale * self.b, other.scale * other.b], axis=1),
                   jnp.concatenate([self.a, other.a], axis=0), jnp.ones((), jnp.float32),
                   self.shape)


@settings.declare(
    rank=settings.integer(16, '[1, inf)', 'the most singular values kept per matrix, r'),
    sv_epsilon=settings.number(0.0, '[0, inf)', 'singular values at or below it are dropped '
                               '(0: none)'),
    energy=settings.number(1.0, '(0, 1]', 'the share of each matrix\'s squared Frobenius norm '
                           'kept, with the fewest singular values (1: up to rank)'),
    distribute_scale=settings.flag(True, 'split Σ between A and B as Σ^½ each; else into A'))
def factor(delta: np.ndarray, *, rank: int, sv_epsilon: float, energy: float,
           distribute_scale: bool, name: str = 'a matrix',
           top: Callable | None = None) -> tuple[LowRank, float]:
  """The truncated factors of one (outputs, inputs) delta, in float32 at s = 1 (its kernel
  (inputs, outputs)), and the share of ‖ΔW‖²_F that B A keeps.

  `top(delta, k)` gives the top k singular triplets (U_k, σ_k, V_kᵀ); by default those of the
  full SVD, as mergekit's. Only the top `rank` are read: ‖ΔW‖²_F, the energy's whole, is
  summed from the entries."""
  if delta.ndim != 2:
    raise UserError(f'{name}: a LoRA factors a matrix; it is {delta.ndim}-D {delta.shape}')
  if rank > min(delta.shape):
    raise UserError(f'{name}: rank {rank} exceeds the matrix {delta.shape}; give a rank of at '
                    f'most {min(delta.shape)}')
  u, s, vt = (np.asarray(x, np.float32) for x in (top or _top)(np.asarray(delta, np.float32),
                                                                rank))
  r = rank
  if sv_epsilon > 0:
    r = min(r, int(np.count_nonzero(s > sv_epsilon)))
  total = float(np.sum(np.square(delta, dtype=np.float64)))
  if energy < 1 and total > 0:
    held = np.cumsum(np.square(s, dtype=np.float64)) / total
    r = min(r, int(np.searchsorted(held, energy)) + 1)
  r = max(r, 1)  # PEFT takes no rank-0 module
  root = np.sqrt(s[:r])
  a_scale, b_scale = (root, root) if distribute_scale else (s[:r], np.ones(r, np.float32))
  kept = float(np.sum(np.square(s[:r], dtype=np.float64)) / total) if total > 0 else 1.0
  factors = LowRank(u[:, :r] * b_scale[None, :], a_scale[:, None] * vt[:r],
                    np.ones((), np.float32), delta.shape[::-1])
  return factors, kept


def _top(delta: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  u, s, vt = np.linalg.svd(delta, full_matrices=False)
  return u[:, :k], s[:k], vt[:k]


def lora_keys(module: str) -> tuple[str, str]:
  """PEFT's saved names of a module's A and B."""
  return f'{PREFIX}{module}.lora_A.weight', f'{PREFIX}{module}.lora_B.weight'


def embedding_keys(module: str) -> tuple[str, str]:
  """PEFT's saved names of an embedding's A (r × num_embeddings) and B (dim × r)."""
  return f'{PREFIX}{module}.lora_embedding_A', f'{PREFIX}{module}.lora_embedding_B'


def saved_key(module: str, parameter: str = 'weight') -> str:
  """PEFT's saved name of a parameter of a module saved whole (`modules_to_save`)."""
  return f'{PREFIX}{module}.{parameter}'
