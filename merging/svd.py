"""A matrix's top k singular triplets, exactly or by a randomized sketch.

Halko, Martinsson and Tropp, "Finding Structure with Randomness: Probabilistic Algorithms for
Constructing Approximate Matrix Decompositions", SIAM Review 2011 (Algorithms 4.4 and 5.1).
For A ∈ ℝ^{m×n}, a target rank k, an oversampling p and q power iterations, with l = k + p
and a Gaussian Ω ∈ ℝ^{n×l},

  Q ← qr(A Ω);   q times: Q ← qr(A qr(Aᵀ Q));   B = Qᵀ A ∈ ℝ^{l×n} = Ũ Σ Vᵀ;   U = Q Ũ,

and the first k columns of U, entries of Σ and rows of Vᵀ are kept. The power iterations
sample (AAᵀ)^q A, whose singular values σ_i^{2q+1} decay faster than A's, and the QR between
each product keeps the small σ_i from being lost to rounding. The expected error, in the
spectral norm, obeys (their eq. 1.11)

  E‖A − QQᵀA‖₂ ≤ [1 + √(k/(p−1)) + (e√(k+p)/p)·√(min(m, n) − k)]^{1/(2q+1)} σ_{k+1},

so the sketch's error tends to the best rank-k error σ_{k+1} (Eckart–Young) as q grows.
Its cost is O(mnl(2q + 2)) against O(mn·min(m, n)) for the full SVD.

The methods that keep only k ≪ min(m, n) triplets of a matrix (TSV-M, CART, Iso-CTS's
task-specific subspaces) take a setting `svd` (`SETTING`): 'full' for the exact SVD, as the
authors' code does, or 'randomized' for the sketch. 'full' is the default: where the spectrum
is flat around σ_k the sketch's rank-k error is near the best, yet its directions near the cut
are not the exact ones, and a merge carries that difference (the whitened merges weigh those
directions as much as the top ones).
"""

import functools

import jax
import jax.numpy as jnp

from editing import settings

# Halko et al.'s p = 10 and q = 2: on σ_i ∝ 1/i the rank-k error is within 0.5% of the best,
# on a flatter σ_i ∝ i^{-1/2} within about 2% (q = 4: 0.5%, at about twice the sketch's cost).
OVERSAMPLE = 10
POWER_ITERATIONS = 2

SOLVERS = ('full', 'randomized')
SETTING = settings.choice('full', SOLVERS, 'how each matrix\'s top singular triplets are '
                          'found: the exact SVD, or a randomized sketch (merging.svd)')

_HIGHEST = jax.lax.Precision.HIGHEST  # the sketch's products must not fall to tf32 or bf16


def thin(matrix: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The thin SVD (U, σ, Vᵀ).

  LAPACK's divide and conquer (gesdd, JAX's default on the CPU) fails to converge on some
  nearly rank-deficient float32 matrices, and JAX then returns NaN: seen on Iso-CTS's stacked
  Vᵀ of SmolLM2's LoRA vectors (σ from 8e-6 to 2.2). Such a matrix is taken again by the QR
  algorithm (gesvd), which converged there to numpy's float64 values.
  """
  return _converged(matrix, full_matrices=False)


def complete(matrix: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The complete SVD (U m × m, σ, Vᵀ n × n), taken again as `thin` takes it where the
  default does not converge."""
  return _converged(matrix, full_matrices=True)


def _converged(matrix: jax.Array, full_matrices: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  found = tuple(jnp.linalg.svd(matrix, full_matrices=full_matrices))
  by_qr = lambda m: jax.lax.linalg.svd(m, full_matrices=full_matrices,
                                       algorithm=jax.lax.linalg.SvdAlgorithm.QR)
  return jax.lax.cond(_finite(found), lambda m: found, by_qr, matrix)


def _finite(triplets) -> jax.Array:
  return jnp.all(jnp.array([jnp.isfinite(x).all() for x in triplets]))


def exact(matrix: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(U[:, :k], σ[:k], Vᵀ[:k]) of the full SVD."""
  u, s, vt = thin(matrix)
  return u[:, :k], s[:k], vt[:k]


def _orthonormal(y: jax.Array) -> jax.Array:
  return jnp.linalg.qr(y)[0]


@functools.partial(jax.jit, static_argnames=('k', 'oversample', 'power_iterations'))
def top_singular(matrix: jax.Array, k: int, *, oversample: int = OVERSAMPLE,
                 power_iterations: int = POWER_ITERATIONS,
                 seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The top k singular triplets (U_k ∈ ℝ^{m×k}, σ_k ∈ ℝ^k, V_kᵀ ∈ ℝ^{k×n}) of `matrix` by a
  randomized sketch of l = k + `oversample` columns and `power_iterations` power iterations.

  Ω is drawn from `seed` alone, so a result depends on the matrix and the seed, not on which
  matrix came before it nor on the device. Where l ≥ min(m, n) the sketch would cost more than
  it saves: the exact SVD is taken and truncated.
  """
  m, n = matrix.shape
  rank = k + oversample
  if rank >= min(m, n):
    return exact(matrix, k)
  omega = jax.random.normal(jax.random.key(seed), (n, rank), matrix.dtype)
  q = _orthonormal(jnp.matmul(matrix, omega, precision=_HIGHEST))
  for _ in range(power_iterations):
    z = _orthonormal(jnp.matmul(matrix.T, q, precision=_HIGHEST))
    q = _orthonormal(jnp.matmul(matrix, z, precision=_HIGHEST))
  u, s, vt = thin(jnp.matmul(q.T, matrix, precision=_HIGHEST))
  return jnp.matmul(q, u[:, :k], precision=_HIGHEST), s[:k], vt[:k]


def top(matrix: jax.Array, k: int, solver: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The top k singular triplets of `matrix` by `solver`, one of `SOLVERS`."""
  if solver == 'full':
    return exact(matrix, k)
  return top_singular(matrix, k)
