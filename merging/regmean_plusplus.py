"""RegMean++: RegMean with each block's input Grams taken on the merged model's own activations.

Nguyen et al., "RegMean++: Enhancing Effectiveness and Generalization of Regression Mean for
Model Merging", arXiv 2508.03121, 2025 (FusionBench's method/regmean_plusplus). RegMean
(merging/regmean.py) takes task t's Grams on its own fine-tuned model, so a layer is merged
for inputs that the merged model never produces. RegMean++ merges stage by stage, in the
order the model calls them, a stage being one block (every linear layer of it) or one linear
layer outside the blocks:

  θ_m ← θ0 + mean_t τ_t                               (every leaf; biases and norms stay so)
  for each stage s, in order:
    G_t = Σ xᵀx of each linear layer of s, over task t's data through the model that is
          θ_m before s and θ_t from s on             (the merged stages make s's input)
    W_m = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_t,   G̃_t = α G_t + (1 − α) diag(G_t),   written into θ_m

so within a block each task's own layers act on what the merged blocks before it made of the
task's data, as in the reference (which merges an encoder layer at a time). The first stage's
inputs are those of RegMean but for the leaves before it, which are already the mean.

Departures from FusionBench's CLIP implementation, which keeps the vision tower's last
LayerNorm at θ0 and normalises each Gram by its token count: here every leaf outside a linear
layer is the tasks' mean, as RegMean's, and the Grams are sums, RegMean's own (the two agree
when the tasks have as many examples). As a task vector, τ_m = θ_m − θ0, applied at λ = 1.
"""

from typing import Sequence

import jax.numpy as jnp

from editing import settings
from editing import tree as tree_lib
from editing.task_vector import TaskVector
from merging import common
from merging import lines
from merging import regmean

NAME = 'regmean_plusplus'


def stages(kernels: Sequence[str]) -> list[tuple[str, ...]]:
  """The kernel paths (in call order) grouped into stages: a block's together, one stage per
  linear layer outside the blocks."""
  grouped: list[tuple[str, ...]] = []
  last_block = None
  for path in kernels:
    block = lines.block_of(path)
    if block is not None and block == last_block:
      grouped[-1] += (path,)
    else:
      grouped.append((path,))
    last_block = block
  return grouped


def _last_stage(path: str, order: Sequence[Sequence[str]]) -> int | None:
  """The last stage leaf `path` belongs to (its block's, or its one layer's module's; a block
  called twice apart is two stages), or None."""
  owners = [index for index, stage in enumerate(order)
            if (lines.block_of(path) == lines.block_of(stage[0])
                if lines.block_of(stage[0]) is not None
                else path.rpartition('/')[0] == stage[0].rpartition('/')[0])]
  return owners[-1] if owners else None


@settings.declare(
    alpha=settings.number(0.9, '[0, 1]', 'the share of each Gram\'s off-diagonal kept'),
    batch_size=settings.integer(64, '[1, inf)', 'examples per Gram batch'))
def merge(task_vectors: Sequence[TaskVector], *, theta0: common.PyTree,
          apply_fn: regmean.ApplyFn, data: dict[str, common.TaskData], alpha: float,
          batch_size: int) -> TaskVector:
  """RegMean++, each task's Grams taken over its `data` images."""
  regmean.check_layered(task_vectors, NAME)
  regmean.check_alpha(alpha, NAME)
  images = [common.task_of(v, data, NAME).images for v in task_vectors]
  flat0 = tree_lib.flatten(theta0)
  deltas = [tree_lib.flatten(v.delta) for v in task_vectors]
  merged = {p: sum(d[p] for d in deltas) / len(deltas) for p in flat0}
  order = stages(regmean.linear_layers(apply_fn, theta0, images[0][:1]))
  last_stage = {p: _last_stage(p, order) for p in flat0}
  for index, stage in enumerate(order):
    # The leaves of this stage and those after it: task t's own in the model of its Grams.
    later = {p for p, last in last_stage.items() if last is not None and last >= index}
    grams = []
    for delta, x in zip(deltas, images):
      params = {p: w0 + (delta[p] if p in later else merged[p]) for p, w0 in flat0.items()}
      grams.append(regmean.gram_matrices(apply_fn, tree_lib.unflatten(params), x, batch_size))
    for path in stage:
      w0 = flat0[path]
      solved = regmean.solve([w0 + d[path] for d in deltas], [g[path] for g in grams], alpha)
      merged[path] = jnp.asarray(solved - w0, w0.dtype)
  return common.merged(task_vectors, tree_lib.unflatten(merged))
