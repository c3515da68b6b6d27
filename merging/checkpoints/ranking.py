"""How a streamed merge ranks magnitudes whole while it merges a block at a time: per tensor,
each model's |τ| ranked on the host into cuts (`editing.tree.Cut`: a threshold and the last tie
kept; a large tensor in one bracketed pass over its blocks); with scope 'global', over all of a
model's tensors by two counting passes."""

import concurrent.futures
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import tree as tree_lib
from editing.models import hf
from editing.task_vector import TaskVector
from merging import dare
from merging import ops
from merging.checkpoints import pipeline
from merging.checkpoints import plan as plan_lib

# A tensor of _SAMPLED entries or more is ranked per tensor in one pass over its pipeline.blocks,
# bracketed by a sample of _CLUSTERS clusters of _CLUSTER contiguous entries (a positioned read
# each), so that ranking it holds a block of its magnitudes, not all (unless the bracket misses:
# then it is ranked whole); a smaller one is ranked whole, each model in a thread of its own,
# which is faster on the benchmark's fixture (1.8 s against 1.9 s). The global ranking's passes
# (scope 'global') read each tensor whole.
_SAMPLED = 1 << 24

_CLUSTERS, _CLUSTER = 64, 1024



def ranked_by(plan: plan_lib.Plan, model: int, label: str, key: jax.Array) -> Callable:
  """ranked(name, τ): what TIES ranks of one model's tensor, τ itself, or after DARE its
  dropped and rescaled τ̃ (the same bits `dare.merge` draws for it)."""
  def ranked(name: str, delta) -> np.ndarray:
    if plan.method == 'dare':
      vector = TaskVector({name: jnp.asarray(delta)}, (label,), 'full', 'streamed')
      p = plan.model_setting('p', model)
      dropped = dare.drop([vector], [p], key, plan.settings['rescale'])
      delta = dropped[0].delta[name]
    return np.asarray(delta, np.float32)
  return ranked



class GlobalRanking:
  """One model's exact top-k of |τ| over all its floating tensors, found by counting, so that
  each tensor's cut is computed alone and keeps what the in-memory global ranking keeps.

  |τ| is non-negative float32, so its bit patterns, read as uint32, order as its values. A
  pass counts the top 16 bits of every entry, which finds the 2^16-wide bucket holding the
  kept-th largest value; a second pass counts the low bits inside that bucket, which finds
  the value v itself, and records per tensor how many entries equal v. A tensor keeps
  |τ| > v, plus the entries equal to v while the running count of them, in tensor order then
  row-major, stays within what the top-k has left: ties go to the earlier entry, as
  `editing.tree.top_k` breaks them.
  """

  def __init__(self, base: hf.Checkpoint, tuned: hf.Checkpoint, names: Sequence[str],
               density: float, ranked: Callable[[str, np.ndarray], np.ndarray]):
    self.names = [n for n in names if is_floating(base, n)]
    self.ranked = ranked
    delta = lambda name: pipeline.host_delta(tuned.tensor(name), base.tensor(name))
    high = np.zeros(1 << 16, np.int64)
    total = 0
    for name in self.names:
      bits = self._bits(name, delta(name))
      high += np.bincount(bits >> 16, minlength=1 << 16)
      total += bits.size
    self.kept = ops.largest_count(density)(total)
    from_top = np.cumsum(high[::-1])
    bucket = (1 << 16) - 1 - int(np.searchsorted(from_top, self.kept))
    above_bucket = int(high[bucket + 1:].sum())
    low = np.zeros(1 << 16, np.int64)
    in_bucket = {}
    for name in self.names:
      bits = self._bits(name, delta(name))
      values, counts = np.unique(bits[(bits >> 16) == bucket] & 0xFFFF, return_counts=True)
      in_bucket[name] = dict(zip(values.tolist(), counts.tolist()))
      low[values] += counts
    from_top = np.cumsum(low[::-1])
    low_bits = (1 << 16) - 1 - int(np.searchsorted(from_top, self.kept - above_bucket))
    self.value = np.uint32((bucket << 16) | low_bits)
    self.above = above_bucket + int(low[low_bits + 1:].sum())
    ties = [in_bucket[n].get(low_bits, 0) for n in self.names]
    self.ties_before = dict(zip(self.names, np.cumsum([0] + ties[:-1]).tolist()))

  def _bits(self, name: str, delta) -> np.ndarray:
    return np.abs(self.ranked(name, delta)).ravel().view(np.uint32)

  def cut(self, name: str, magnitudes: np.ndarray) -> tree_lib.Cut:
    """What the ranking keeps of the tensor `name`, whose ranked magnitudes (|τ|, or DARE's
    |τ̃|) are `magnitudes`, flat."""
    return tree_lib.cut_at(self.value.view(np.float32).item(),
                           magnitudes.view(np.uint32) == self.value,
                           self.kept - self.above - self.ties_before[name])



def is_floating(ckpt: hf.Checkpoint, name: str) -> bool:
  return bool(jnp.issubdtype(ckpt.header(name)[1], jnp.floating))



class TensorRanking:
  """The cuts of each model's ranked masks of a tensor (TIES' largest, Breadcrumbs' band),
  computed on the host before the tensor's pipeline.blocks merge; with scope 'global', from each
  model's `GlobalRanking`. `pool` runs each model's ranking in a thread."""

  def __init__(self, base: hf.Checkpoint, tuned: Sequence[hf.Checkpoint], plan: plan_lib.Plan,
               pool: concurrent.futures.Executor, key: jax.Array, labels: Sequence[str]):
    self.base, self.tuned, self.plan, self.pool = base, list(tuned), plan, pool
    # Before anything is written: the counting passes read every tensor.
    self.rankings = ([GlobalRanking(base, ckpt, sorted(base.files),
                                    plan.model_setting('density', i),
                                    ranked_by(plan, i, label, key))
                      for i, (ckpt, label) in enumerate(zip(self.tuned, labels))]
                     if plan.global_ties else None)

  def magnitudes(self, name: str, size: int, model: int) -> np.ndarray:
    """|τ| of one model's tensor, flat, in float32 (the values the merge's masks compare), in
    an array of this thread's that the next call overwrites."""
    # Grown to the largest tensor: a new array per tensor would be faulted in page by page,
    # and faults in parallel threads wait on each other.
    if getattr(pipeline.thread_buffers, 'magnitudes', np.empty(0)).size < size:
      pipeline.thread_buffers.magnitudes = np.empty(size, np.float32)
    out = pipeline.thread_buffers.magnitudes[:size]
    _, dtype = self.base.header(name)
    for start, stop in pipeline.blocks(size):
      theta, theta0 = pipeline.read_block([self.tuned[model], self.base], name, start, stop,
                                 stop - start, dtype)
      np.abs(pipeline.host_delta(theta, theta0, out=out[start:stop]), out=out[start:stop])
    return out

  def cuts(self, name: str, size: int,
           plan: plan_lib.Plan) -> list[tuple[tree_lib.Cut, ...]]:
    """Each model's cuts of its ranked masks of the tensor: TIES keeps the largest (as the
    global ranking says, with scope 'global'); Breadcrumbs the not-smallest but the largest.
    A large tensor is ranked by one pass over its pipeline.blocks; what that pass cannot place (and
    every smaller tensor) is ranked whole, each model in a thread of its own (numpy releases
    the GIL)."""
    if self.rankings is not None:
      return list(self.pool.map(
          lambda i: (self.rankings[i].cut(name, self.magnitudes(name, size, i)),),
          range(len(self.tuned))))
    kept = []
    for model in range(len(self.tuned)):
      if plan.method == 'ties':
        counts = (ops.largest_count(plan.model_setting('density', model)),)
      else:
        counts = ops.band_counts(plan.settings['top'], plan.settings['bottom'])
      kept.append([count(size) for count in counts])
    # A count that keeps none or all of the entries reads none of them.
    found = [[tree_lib.fixed_cut(size, k) for k in model_kept] for model_kept in kept]
    ranked = [j for j in range(len(kept[0])) if any(row[j] is None for row in found)]
    if size >= _SAMPLED and ranked:
      counts = [[model_kept[j] for j in ranked] for model_kept in kept]
      for row, cuts in zip(found, self._bracketed_cuts(name, size, counts)):
        for j, cut in zip(ranked, cuts):
          row[j] = row[j] or cut

    def fill(model: int) -> tuple[tree_lib.Cut, ...]:
      if None not in found[model]:
        return tuple(found[model])
      magnitudes = self.magnitudes(name, size, model)
      return tuple(c or tree_lib.largest_cut(magnitudes, k)
                   for c, k in zip(found[model], kept[model]))

    return list(self.pool.map(fill, range(len(self.tuned))))

  def _bracketed_cuts(self, name: str, size: int, kept: Sequence[Sequence[int]]) -> list[list]:
    """Each model's cut of each of its kept counts (kept[model]), from one pass over the tensor's pipeline.blocks (None where
    it cannot tell): a sample (clusters of contiguous entries, a positioned read each)
    brackets each kept-th largest |τ|, one jitted program per block says which entries lie
    above, inside and below the brackets, and the selection runs among those inside
    (`editing.tree.Bracketed`). A NaN is placed below every bracket, which is wrong, but a
    NaN in an input stops the merge at its block (a ranked method cannot allow them)."""
    _, dtype = self.base.header(name)
    ckpts = [self.base] + self.tuned
    step = size // _CLUSTERS
    samples = np.empty((len(self.tuned), _CLUSTERS, _CLUSTER), np.float32)
    for c in range(_CLUSTERS):
      base, *thetas = pipeline.read_block(ckpts, name, c * step, c * step + _CLUSTER, _CLUSTER, dtype)
      for i, theta in enumerate(thetas):
        np.abs(pipeline.host_delta(theta, base), out=samples[i, c])
    bounds = np.array([[tree_lib.bracket(sample, size, k) for k in model_kept]
                       for sample, model_kept in zip(samples, kept)], np.float32)
    spans = pipeline.blocks(size)
    halves = [spans[:len(spans) // 2], spans[len(spans) // 2:]]
    # The two halves of the pass in threads of their own, then joined in order.
    first, second = self.pool.map(lambda half: self._bracket_pass(name, half, bounds), halves)
    return [[a.join(b).cut(k) for a, b, k in zip(ones, others, model_kept)]
            for ones, others, model_kept in zip(first, second, kept)]

  def _bracket_pass(self, name: str, spans: Sequence[tuple[int, int]],
                    bounds: np.ndarray) -> list[list[tree_lib.Bracketed]]:
    """What the pipeline.blocks `spans` of the tensor hold of each model's brackets."""
    _, dtype = self.base.header(name)
    counted = [[tree_lib.Bracketed(0, [], []) for _ in row] for row in bounds]
    for start, stop in spans:
      buffers = pipeline.read_block([self.base] + self.tuned, name, start, stop, pipeline.BLOCK, dtype)
      codes = np.asarray(_bracket_block(buffers[0], buffers[1:], bounds))[:, :, :stop - start]
      for i, model_counted in enumerate(counted):
        for j, code in enumerate(codes[i]):
          where = np.flatnonzero(code == 1)
          inside = np.abs(pipeline.host_delta(buffers[i + 1][where], buffers[0][where]))
          model_counted[j] = model_counted[j].extend(np.count_nonzero(code == 2), where + start,
                                                     inside)
    return counted


@jax.jit
def _bracket_block(base: jax.Array, thetas: list, bounds: jax.Array) -> jax.Array:
  """Per model and bracket (bounds[model, bracket] = lower, upper), each entry of a block: 0
  where |τ| lies below the bracket, 1 inside it, 2 above it (int8)."""
  magnitudes = jnp.stack([jnp.abs(jnp.asarray(t, jnp.float32) - jnp.asarray(base, jnp.float32))
                          for t in thetas])[:, None, :]
  lower, upper = bounds[:, :, :1], bounds[:, :, 1:]
  return (magnitudes >= lower).astype(jnp.int8) + (magnitudes > upper).astype(jnp.int8)

