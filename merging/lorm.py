"""LoRM: one LoRA adapter fitted to every task's inputs by alternating closed-form solves.

Salami et al., "Closed-form merging of parameter-efficient modules for federated continual
learning", ICLR 2025. For each adapted kernel, with task t's delta ΔW_t = s_t B_t A_t
(outputs × inputs) and the Gram G_t = Σ_x x xᵀ of that layer's inputs on its own fine-tuned
model (`merging.regmean.gram_matrices`), the merged B A minimises

  L(B, A) = Σ_t ‖(ΔW_t − B A) X_tᵀ‖²_F = Σ_t tr((ΔW_t − B A) G_t (ΔW_t − B A)ᵀ),

one factor at a time, each in closed form with M = Σ_t ΔW_t G_t and G = Σ_t G_t:

  B ← M Aᵀ (A G Aᵀ)⁺,          A ← (Bᵀ B)⁺ Bᵀ M G⁺.

When the tasks share the other factor these are the paper's solves, B = (Σ_t B_t A G_t) Aᵀ
(A G Aᵀ)⁺ and A = (Σ_t A_t G_t) G⁺; with separate adapters they are the least-squares optimum
of L in that factor. Each solve never raises L, so the alternation descends. Like RegMean, the
Grams are shrunk first, G_t ← α G_t + (1 − α) diag(G_t); the authors' runs use α = 0 for the
backbone (diagonal Grams). The merge is applied at λ = 1.

Choices where the paper is silent for adapters trained apart (its clients share a factor
each round): the rank is the largest r_t, the alternation starts from the best rank-r cut of
Σ_t ΔW_t (an SVD), and runs `rounds` B-then-A solves, in float64 as the authors solve.
"""

from typing import Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from editing import regimes
from editing import settings
from editing.errors import UserError
from editing.lora import LowRank
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import regmean


def solve_b(m: np.ndarray, g: np.ndarray, a: np.ndarray) -> np.ndarray:
  """argmin_B L for fixed A: M Aᵀ (A G Aᵀ)⁺."""
  return m @ a.T @ np.linalg.pinv(a @ g @ a.T)


def solve_a(m: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
  """argmin_A L for fixed B: (Bᵀ B)⁺ Bᵀ M G⁺."""
  return np.linalg.pinv(b.T @ b) @ b.T @ m @ np.linalg.pinv(g)


def loss(deltas: Sequence[np.ndarray], grams: Sequence[np.ndarray], b: np.ndarray,
         a: np.ndarray) -> float:
  """L(B, A) = Σ_t tr((ΔW_t − B A) G_t (ΔW_t − B A)ᵀ)."""
  return float(sum(np.trace((d - b @ a) @ g @ (d - b @ a).T) for d, g in zip(deltas, grams)))


def fit(deltas: Sequence[np.ndarray], grams: Sequence[np.ndarray], rank: int,
        rounds: int) -> tuple[np.ndarray, np.ndarray]:
  """(B, A) of rank `rank` after `rounds` alternations, from the SVD cut of Σ_t ΔW_t."""
  m, g = sum(d @ gt for d, gt in zip(deltas, grams)), sum(grams)
  u, s, vt = np.linalg.svd(sum(deltas), full_matrices=False)
  b, a = u[:, :rank] * s[:rank], vt[:rank]
  for _ in range(rounds):
    b = solve_b(m, g, a)
    a = solve_a(m, g, b)
  return b, a


@settings.declare(
    rounds=settings.integer(10, '[1, inf)', 'alternations of the B and A solves'),
    alpha=settings.number(0.0, '[0, 1]', "the Grams' off-diagonal kept, αG + (1 − α) diag G "
                          "(the authors' 0: diagonal)"),
    batch_size=settings.integer(64, '[1, inf)', 'examples per Gram batch'))
def merge(task_vectors: Sequence[TaskVector], *, theta0: common.PyTree, apply_fn: Callable,
          data: Mapping[str, common.TaskData], rounds: int, alpha: float,
          batch_size: int) -> TaskVector:
  """The LoRM adapter of the LoRA task vectors, from each task's Grams on its own model."""
  check_compatible(task_vectors, 'lorm')
  first = task_vectors[0]
  if not first.low_rank:
    raise UserError(f'lorm merges LoRA task vectors; these ({first.regime}) are dense')
  if first.regime in regimes.TANGENT:
    raise UserError(f'lorm fits the inputs of the model\'s own layers; {first.regime} task '
                    'vectors act through the tangent model, which has no such layers')
  grams = [regmean.gram_matrices(apply_fn, v.apply_to(theta0),
                                 common.task_of(v, data, 'lorm').images, batch_size)
           for v in task_vectors]
  delta = {}
  for path, factors in first.delta.items():
    deltas = [np.asarray(v.delta[path].matrix(), np.float64) for v in task_vectors]
    shrunk = [alpha * g[path] + (1 - alpha) * np.diag(np.diag(g[path])) for g in grams]
    rank = max(v.delta[path].rank for v in task_vectors)
    b, a = fit(deltas, shrunk, rank, rounds)
    delta[path] = LowRank(jnp.asarray(b, jnp.float32), jnp.asarray(a, jnp.float32),
                          jnp.ones((), jnp.float32), factors.shape)
  return common.merged(task_vectors, delta)
