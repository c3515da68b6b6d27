"""How a streamed merge ranks magnitudes whole while it merges a block at a time: each model's
|τ| (or what its draw left) ranked on the host by `editing.cuts` at the counts of the cut its
method declares (`merging.sparsity.Cut`), into cuts (a threshold and the last tie kept), per
tensor or, with scope 'global', over all of a model's floating tensors; the passes of the
select read a large tensor a block at a time and the global ranking's read each tensor whole."""

import concurrent.futures
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import cuts
from editing.models import hf
from merging import ops
from merging import sparsity
from merging.checkpoints import pipeline
from merging.checkpoints import plan as plan_lib

# A tensor of at most HELD entries (64 MB of float32 magnitudes a model: a 4,096 × 4,096 matrix,
# or Llama-3.2-1B's MLP matrices) is ranked from its magnitudes held whole (read once, each model
# in a thread of its own); a larger one by passes a block at a time, which hold a block of its
# magnitudes, not all of them: one pass where a sample of _CLUSTERS clusters of _CLUSTER
# contiguous entries (a positioned read each) brackets the kept-th largest, else two.
HELD = 1 << 24
_CLUSTERS, _CLUSTER = 64, 1024


def cut_of(plan: plan_lib.Plan, model: int) -> sparsity.Cut:
  """The cut the method declares of model `model`'s vector; of a model it cuts nothing of,
  one that keeps every entry."""
  return plan.sparsity(model).cut or sparsity.Cut(lambda n: n)


def ranked_by(plan: plan_lib.Plan, model: int, label: str, key: jax.Array) -> Callable:
  """ranked(name, τ): what a model's cut ranks of its tensor: τ itself, or after the model's
  declared draw its τ̃ (the bits the method's merge draws for it, keyed by `label`)."""
  draw = plan.sparsity(model).draw

  def ranked(name: str, delta) -> np.ndarray:
    if draw is not None:
      delta = ops.drop_and_rescale({name: jnp.asarray(delta)}, draw.p,
                                   ops.vector_key(key, (label,)), draw.rescale, draw.spread)[name]
    return np.asarray(delta, np.float32)
  return ranked


def kept_mask(magnitudes, model_cuts: Sequence[cuts.Cut]):
  """What a model's cuts of a tensor keep of its `magnitudes` (numpy on the host, or a block
  traced in jnp): the first count's largest, less the second's (`sparsity.Cut`)."""
  masks = [cuts.cut_mask(magnitudes, cut) for cut in model_cuts]
  return masks[0] if len(masks) == 1 else masks[0] & ~masks[1]


class GlobalRanking:
  """One model's exact top-k of |τ| over all its floating tensors (in name order, then
  row-major; ties to the earlier entry, as `editing.tree.top_k` breaks them) for each count of
  its cut, found by one `editing.cuts.select` whose chunks are the tensors, so that each
  tensor's cut is computed alone and keeps what the in-memory global ranking keeps."""

  def __init__(self, base: hf.Reader, tuned: hf.Reader, names: Sequence[str],
               cut: sparsity.Cut, ranked: Callable[[str, np.ndarray], np.ndarray]):
    self.names = [n for n in names if is_floating(base, n)]
    self.index = {name: i for i, name in enumerate(self.names)}
    self.ranked = ranked
    total = sum(math.prod(base.header(n)[0]) for n in self.names)
    self.kept = [count(total) for count in cut.counts]
    # A count that keeps none or all of the entries reads none of them.
    self.selections = [None] * len(self.kept)
    todo = [j for j, k in enumerate(self.kept) if cuts.fixed_cut(total, k) is None]
    if todo:
      magnitudes = lambda: (
          np.abs(ranked(n, pipeline.host_delta(tuned.tensor(n), base.tensor(n))))
          for n in self.names)
      found = cuts.select(magnitudes, np.float32, total, [self.kept[j] for j in todo])
      for j, selection in zip(todo, found):
        self.selections[j] = selection

  def cuts(self, name: str, magnitudes: np.ndarray) -> tuple[cuts.Cut, ...]:
    """What the ranking keeps of the tensor `name`, whose ranked magnitudes (|τ|, or after a
    draw |τ̃|) are `magnitudes`, flat: a cut per count."""
    return tuple(
        cuts.fixed_cut(magnitudes.size, magnitudes.size if kept > 0 else 0) if selection is None
        else selection.cut(self.index[name], magnitudes)
        for kept, selection in zip(self.kept, self.selections))


def is_floating(ckpt: hf.Reader, name: str) -> bool:
  return bool(jnp.issubdtype(ckpt.header(name)[1], jnp.floating))


class TensorRanking:
  """The cuts of each model's ranked masks of a tensor (the counts of its declared cut),
  computed on the host before the tensor's pipeline.blocks merge; with scope 'global', from each
  model's `GlobalRanking`. `pool` runs each model's ranking in a thread."""

  def __init__(self, base: hf.Reader, tuned: Sequence[hf.Reader], plan: plan_lib.Plan,
               pool: concurrent.futures.Executor, key: jax.Array, labels: Sequence[str]):
    self.base, self.tuned, self.plan, self.pool = base, list(tuned), plan, pool
    # Before anything is written: the global select's passes read every tensor.
    self.rankings = ([GlobalRanking(base, ckpt, sorted(base.files), cut_of(plan, i),
                                    ranked_by(plan, i, label, key))
                      for i, (ckpt, label) in enumerate(zip(self.tuned, labels))]
                     if plan.global_cut else None)

  def magnitudes(self, name: str, model: int, start: int, stop: int) -> np.ndarray:
    """|τ| of entries [start, stop) of one model's tensor, flat, in float32 (the values the
    merge's masks compare), in an array of this thread's that the next call overwrites."""
    # Grown to the largest span: a new array per tensor would be faulted in page by page, and
    # faults in parallel threads wait on each other.
    if getattr(pipeline.thread_buffers, 'magnitudes', np.empty(0)).size < stop - start:
      pipeline.thread_buffers.magnitudes = np.empty(stop - start, np.float32)
    out = pipeline.thread_buffers.magnitudes[:stop - start]
    _, dtype = self.base.header(name)
    for first, last in pipeline.blocks(stop - start):
      theta, theta0 = pipeline.read_block([self.tuned[model], self.base], name, start + first,
                                          start + last, last - first, dtype)
      np.abs(pipeline.host_delta(theta, theta0, out=out[first:last]), out=out[first:last])
    return out

  def cuts(self, name: str, size: int, plan: plan_lib.Plan) -> list[tuple[cuts.Cut, ...]]:
    """Each model's cuts of the tensor, one per count of its declared cut (as the global
    ranking says, with scope 'global'). Each model is ranked in a thread of its own (numpy
    releases the GIL)."""
    if self.rankings is not None:
      return list(self.pool.map(
          lambda i: self.rankings[i].cuts(name, self.magnitudes(name, i, 0, size)),
          range(len(self.tuned))))

    def ranked(model: int) -> tuple[cuts.Cut, ...]:
      kept = [count(size) for count in cut_of(plan, model).counts]
      # A count that keeps none or all of the entries reads none of them.
      found = [cuts.fixed_cut(size, k) for k in kept]
      todo = [j for j, cut in enumerate(found) if cut is None]
      if not todo:
        return tuple(found)
      if size <= HELD:
        held = self.magnitudes(name, model, 0, size)
        for j, cut in zip(todo, cuts.largest_cuts(held, [kept[j] for j in todo])):
          found[j] = cut
      else:
        spans = pipeline.blocks(size)
        chunk = lambda i: self.magnitudes(name, model, *spans[i])
        step = size // _CLUSTERS
        sample = np.concatenate([
            self.magnitudes(name, model, c * step, c * step + min(_CLUSTER, step)).copy()
            for c in range(_CLUSTERS)])
        for j, cut in zip(todo, cuts.chunked_cuts(chunk, [start for start, _ in spans],
                                                  np.float32, size, [kept[j] for j in todo],
                                                  sample)):
          found[j] = cut
      return tuple(found)

    return list(self.pool.map(ranked, range(len(self.tuned))))
