"""LiNeS: a merged task vector scaled by depth, little near the input and more toward the output.

Wang et al., "LiNeS: Post-training Layer Scaling Prevents Forgetting and Enhances Model
Merging", ICLR 2025. For the block ℓ ∈ {0, …, L − 1} a leaf lies in (read from its path),

  λ_ℓ = α + β · ℓ / (L − 1),

and λ = α for the leaves outside the blocks (embeddings, the last norm and projection). It
modifies any merge's τ_m: for multi-task merging the authors set α = (‖Σ_t τ_t‖₁ / ‖τ_m‖₁) / T
(1/T for task arithmetic) and choose β on validation.
"""

import re
from typing import Sequence

import jax.numpy as jnp

from editing import tree as tree_lib
from editing.task_vector import TaskVector

# A block's index in a path: this project's ViT ('blocks_3/...') or a Hugging Face name
# ('...layers.3.', '...layer.3.', '...h.3.').
_BLOCK = re.compile(r'(?:^|/)blocks_(\d+)/|\.(?:layers|layer|h|blocks)\.(\d+)\.')


def block_of(path: str) -> int | None:
  """The block index of a leaf's path, or None outside the blocks."""
  match = _BLOCK.search(path)
  return None if match is None else int(match.group(1) or match.group(2))


def scale(vector: TaskVector, alpha: float, beta: float) -> TaskVector:
  """λ_ℓ · τ per leaf."""
  depths = {p: block_of(p) for p in tree_lib.flatten(vector.delta)}
  blocks = [d for d in depths.values() if d is not None]
  last = max(blocks, default=0)

  def scaled(path, x):
    depth = depths[path]
    factor = alpha if depth is None or last == 0 else alpha + beta * depth / last
    return factor * x

  return vector.replace(delta=tree_lib.map_with_path(scaled, vector.delta))


def multi_task_alpha(task_vectors: Sequence[TaskVector], merged: TaskVector) -> float:
  """α = (‖Σ_t τ_t‖₁ / ‖τ_m‖₁) / T."""
  l1 = lambda v: float(sum(jnp.sum(jnp.abs(x)) for x in tree_lib.flatten(v.delta).values()))
  return l1(sum(task_vectors)) / max(l1(merged), 1e-30) / len(task_vectors)
