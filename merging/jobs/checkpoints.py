"""Merging Hugging Face checkpoints of any size, a block at a time, through `merging`'s methods.

A base checkpoint θ0 and N fine-tuned checkpoints of the same architecture (any: an LLM, a ViT)
are read lazily (`editing.models.hf.Checkpoint`: positioned reads of a tensor's entries, never
a whole model). For every tensor name, in sorted order, the N deltas τ_t = θ_t − θ0 (in
float32) become one-leaf task vectors, the configured method merges them (the same function the
suite's merges call; DARE's randomness is keyed by the tensor's name, so the bits depend neither
on order nor on sharding), and θ0 + λ·τ_m is written in θ0's dtype:

  averaging, task_arithmetic, ties, dare, breadcrumbs, consensus
                 θ0 + λ·merge(τ_1..τ_N)
  negation       θ0 − λ·τ_1 (one fine-tuned model)
  extract        τ_1 itself, in float32 (one fine-tuned model)

A tensor is merged in blocks of `_BLOCK` entries (the last one padded), each block of the N + 1
inputs read, merged by one call of a jitted program and written while it is in the processor's
cache; one program serves every block, so a whole model compiles once per method and dtype. The
masks a method ranks (TIES' top-k, Breadcrumbs' band) need the whole tensor: before its blocks,
each model's |τ| is ranked on the host into a cut (`editing.tree.Cut`: a threshold and the last
tie kept; a large tensor in one bracketed pass over its blocks), and each block draws its masks
from the cuts. TIES with scope 'global' (alone or after DARE) ranks each model's magnitudes over
all its tensors: two counting passes find the exact threshold first (`_GlobalRanking`). DARE
merges a tensor whole, op by op under its own name, so that its draws are the in-memory
merge's. Blocks run on all local devices, split over them where the device count divides the
block, and `prefetch` blocks are read and merged in threads while one is written, the next
tensors' rankings beside them.

Methods that read data (Fisher, RegMean, AdaMerging, DAM) are refused. The output is a Hugging
Face directory: safetensors shards of at most `shard_bytes` with their index, and the base's
config.json and tokenizer files. It is built in `<output>.partial/`, each shard written to a
temporary name and renamed, and the directory renamed into place at the end; the shard plan is
a pure function of the inputs, so a run killed at any point and rerun keeps the finished shards
and writes the same bytes as an uninterrupted run.
"""

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import math
import os
import shutil
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import logging

import merging
from editing import checkpoint
from editing import sharding
from editing import tree as tree_lib
from editing.errors import UserError
from editing.models import hf
from editing.task_vector import TaskVector
from merging import dare
from merging import ops
from merging.jobs import mergekit

DATA_FREE = ('averaging', 'task_arithmetic', 'ties', 'dare', 'breadcrumbs', 'consensus')
SINGLE_MODEL = ('negation', 'extract')
METHODS = DATA_FREE + SINGLE_MODEL
# The methods that take per-model weights (and `normalize`), as mergekit's do.
WEIGHTED = ('task_arithmetic', 'ties', 'dare')
_LEAF = 'tensor'  # the name of the one leaf a block's jitted merge sees
# Entries per block: a block of each of the N + 1 inputs (1 MB each in float32) stays in the
# processor's cache from its read to its write.
_BLOCK = 1 << 18
# Tensors prepared (TIES' and Breadcrumbs' rankings), two at a time, ahead of the one being
# merged, so that the ranking threads keep busy through a run of small tensors.
_PREPARED_AHEAD, _PREPARING = 3, 2
# A tensor of _SAMPLED entries or more is ranked per tensor in one pass over its blocks,
# bracketed by a sample of _CLUSTERS clusters of _CLUSTER contiguous entries (a positioned read
# each), so that ranking it holds a block of its magnitudes, not all (unless the bracket misses:
# then it is ranked whole); a smaller one is ranked whole, each model in a thread of its own,
# which is faster on the benchmark's fixture (1.8 s against 1.9 s). The global ranking's passes
# (scope 'global') read each tensor whole.
_SAMPLED = 1 << 24
_CLUSTERS, _CLUSTER = 64, 1024
# The methods whose masks rank each tensor's magnitudes as a whole before its blocks merge.
_RANKED = ('ties', 'breadcrumbs')
# DARE draws each tensor's masks over its whole shape from a key folded with its name, so it
# merges a tensor whole, not in blocks; jitted, that would compile a program per tensor (2.4×
# slower end to end on the benchmark's fixture), so it runs op by op under the tensor's own
# name, in the streamed merge and in the in-memory reference.
_OP_BY_OP = ('dare',)
_OUTPUT_DTYPES = {'float32': np.dtype(np.float32), 'bfloat16': np.dtype(ml_dtypes.bfloat16),
                  'float16': np.dtype(np.float16)}
_COPIED = ('config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json',
           'special_tokens_map.json', 'tokenizer.model', 'vocab.txt', 'vocab.json', 'merges.txt')


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a merge does: the method, its settings, λ and the output's shard size."""

  method: str
  settings: dict
  scale: float = 1.0  # λ
  seed: int = 0  # DARE's key
  shard_bytes: int = 2 * 1024**3
  allow_nonfinite: bool = False
  weights: tuple[float, ...] | None = None  # per fine-tuned model, in order
  dtype: str | None = None  # of the merged floating tensors; default the base's
  # Blocks read and merged ahead, each in a thread, while one is written: more is faster up
  # to the cores there are.
  prefetch: int = 2

  def __hash__(self):  # a static argument of the jitted per-block merge
    return self._hash

  @functools.cached_property
  def _hash(self) -> int:  # once: the merge hashes the plan at every block
    return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v
                      for v in dataclasses.astuple(self)))

  def __post_init__(self):
    if self.method not in METHODS:
      reads = merging.REGISTRY.get(self.method)
      if reads is not None:
        raise UserError(f'{self.method} reads data ({", ".join(reads.reads)}); checkpoint '
                        f'merging runs only the data-free methods {METHODS}')
      raise UserError(f'unknown checkpoint merge method {self.method!r}; known: {METHODS}')
    if self.allow_nonfinite and (self.method in _RANKED or self.global_ties):
      raise UserError(f'{self.method} ranks magnitudes, and a NaN has no rank; it cannot allow '
                      'non-finite inputs')
    if self.shard_bytes < 1:
      raise UserError(f'shard_bytes = {self.shard_bytes}: must be positive')
    if self.prefetch < 1:
      raise UserError(f'prefetch = {self.prefetch}: must be at least 1')
    if self.weights is not None and self.method not in WEIGHTED:
      raise UserError(f'{self.method} takes no per-model weights; the methods that do: '
                      f'{WEIGHTED}')
    if self.dtype is not None and self.dtype not in _OUTPUT_DTYPES:
      raise UserError(f'dtype {self.dtype!r}: the output can be written in one of '
                      f'{sorted(_OUTPUT_DTYPES)}')

  @property
  def global_ties(self) -> bool:
    """TIES (alone or after DARE) ranking each model's magnitudes as a whole: counting passes
    come first."""
    ties_follows = self.method == 'ties' or (self.method == 'dare' and
                                             self.settings.get('then') == 'ties')
    return ties_follows and self.settings.get('scope', 'global') == 'global'


def merge(base: str, models: Sequence[str], output: str, plan: Plan) -> dict:
  """Merges `models` onto `base` into the Hugging Face directory `output`; returns a summary."""
  if plan.method in SINGLE_MODEL and len(models) != 1:
    raise UserError(f'{plan.method} takes exactly one fine-tuned model, got {len(models)}')
  if not models:
    raise UserError('no fine-tuned model to merge')
  if plan.weights is not None and len(plan.weights) != len(models):
    raise UserError(f'{len(plan.weights)} weights for {len(models)} fine-tuned models: give one '
                    'per model, in order')
  base_ckpt = hf.Checkpoint(base)
  ckpts = [hf.Checkpoint(m) for m in models]
  names = sorted(base_ckpt.files)
  for path, ckpt in zip(models, ckpts):
    missing = sorted(set(names) - set(ckpt.files))
    extra = sorted(set(ckpt.files) - set(names))
    if missing or extra:
      raise UserError(f'{path} does not have the tensors of {base}: missing {missing[:5]}'
                      f'{"..." if len(missing) > 5 else ""}, extra {extra[:5]}'
                      f'{"..." if len(extra) > 5 else ""}')
  shards = _shards(base_ckpt, names, plan)
  partial = output.rstrip('/') + '.partial'
  os.makedirs(partial, exist_ok=True)
  start, done_bytes, total_bytes = time.time(), 0, sum(s['bytes'] for s in shards)
  done_tensors = 0
  with _pool(len(ckpts)) as pool:
    tensors = _TensorMerge(base_ckpt, ckpts, models, plan, pool)
    for shard in shards:
      path = os.path.join(partial, shard['file'])
      if not os.path.exists(path):
        write_streamed(path, shard['entries'], tensors.prepare, tensors.block, plan.prefetch)
      done_bytes += shard['bytes']
      done_tensors += len(shard['names'])
      rate = done_bytes / max(time.time() - start, 1e-9)
      logging.info('%s: %d/%d tensors, %.0f tensors/s, %.1f MB/s, eta %.0f s', shard['file'],
                   done_tensors, len(names), done_tensors / max(time.time() - start, 1e-9),
                   rate / 1e6, (total_bytes - done_bytes) / max(rate, 1e-9))
  _finish(base, partial, output, shards)
  return {'output': output, 'tensors': len(names), 'shards': len(shards),
          'bytes': total_bytes, 'seconds': time.time() - start}


def blocks(size: int) -> list[tuple[int, int]]:
  """The blocks [start, stop) of a tensor of `size` entries, each merged by one program call:
  (N + 1) inputs of a block stay in the processor's cache while they are read, merged and
  written."""
  return [(b, min(size, b + _BLOCK)) for b in range(0, size, _BLOCK)]


def write_streamed(path: str, entries: list[tuple[str, tuple[int, ...], np.dtype]],
                   prepare: Callable[[str], Any], block: Callable[[Any, int, int], np.ndarray],
                   depth: int) -> None:
  """The safetensors file `path` of `entries`, each tensor written a block at a time: the
  tensors' prepare(name) calls run in threads, _PREPARING at a time, up to _PREPARED_AHEAD
  tensors ahead of the one being written, and a tensor's block(prepared, start, stop) calls
  (1-D arrays of the entry's dtype) run `depth` ahead in threads while the caller writes the
  current one. File reads, numpy and XLA release the GIL, so reads, merges and writes overlap;
  in memory are the blocks in flight and what prepare keeps of _PREPARED_AHEAD + 1 tensors
  (for DARE, each one merged whole)."""
  sizes = {name: math.prod(shape) for name, shape, _ in entries}
  with _pool(_PREPARING) as preparing, _pool(depth) as merges:
    prepared = _ahead(prepare, list(sizes), _PREPARED_AHEAD, preparing)

    def chunks(name: str) -> Iterator[np.ndarray]:
      state = next(prepared)
      yield from _ahead(lambda span: block(state, *span), blocks(sizes[name]), depth, merges)

    checkpoint.write_safetensors(path, entries, chunks, metadata={'format': 'pt'})


@contextlib.contextmanager
def _pool(workers: int) -> Iterator[concurrent.futures.ThreadPoolExecutor]:
  """Threads that live as long as the block (the merge's read buffers are theirs); after an
  error or an interrupt, the work not yet started is dropped, not run."""
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
  try:
    yield pool
  finally:
    pool.shutdown(wait=True, cancel_futures=True)


def _ahead(produce: Callable[[Any], Any], items: Sequence, depth: int,
           pool: concurrent.futures.Executor) -> Iterator:
  """produce(item) for each item in order, the next `depth` produced in `pool` while the
  caller uses the current one."""
  pending = collections.deque()
  try:
    for item in items:
      pending.append(pool.submit(produce, item))
      if len(pending) > depth:
        yield pending.popleft().result()
    while pending:
      yield pending.popleft().result()
  finally:
    for future in pending:
      future.cancel()


def _shards(base: hf.Checkpoint, names: list[str], plan: Plan) -> list[dict]:
  """Consecutive names grouped into shards of at most plan.shard_bytes of output."""
  shards: list[dict] = []
  for name in names:
    shape, dtype = base.header(name)
    # τ is written in float32; merged weights in the plan's dtype, else the base's.
    if jnp.issubdtype(dtype, jnp.floating):
      dtype = _output_dtype(plan, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if not shards or (shards[-1]['bytes'] + nbytes > plan.shard_bytes and shards[-1]['names']):
      shards.append({'names': [], 'entries': [], 'bytes': 0})
    shards[-1]['names'].append(name)
    shards[-1]['entries'].append((name, shape, dtype))
    shards[-1]['bytes'] += nbytes
  for i, shard in enumerate(shards):
    shard['file'] = (hf.SINGLE if len(shards) == 1 else
                     f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors')
  return shards


def _output_dtype(plan: Plan, base_dtype: np.dtype) -> np.dtype:
  """The dtype a floating tensor is written in."""
  if plan.method == 'extract':
    return np.dtype(np.float32)
  return _OUTPUT_DTYPES[plan.dtype] if plan.dtype else np.dtype(base_dtype)


def _ranked(plan: Plan, label: str, key: jax.Array) -> Callable:
  """ranked(name, τ): what TIES ranks of one model's tensor, τ itself, or after DARE its
  dropped and rescaled τ̃ (the same bits `dare.merge` draws for it)."""
  def ranked(name: str, delta) -> np.ndarray:
    if plan.method == 'dare':
      vector = TaskVector({name: jnp.asarray(delta)}, (label,), 'full', 'streamed')
      delta = dare.drop([vector], _setting(plan, 'p'), key)[0].delta[name]
    return np.asarray(delta, np.float32)
  return ranked


class _GlobalRanking:
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
    self.names = [n for n in names if _is_floating(base, n)]
    self.ranked = ranked
    delta = lambda name: _host_delta(tuned.tensor(name), base.tensor(name))
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


def _is_floating(ckpt: hf.Checkpoint, name: str) -> bool:
  return bool(jnp.issubdtype(ckpt.header(name)[1], jnp.floating))


class _TensorMerge:
  """How each tensor is merged: `prepare` checks a tensor's inputs and does what needs the
  whole tensor (the cuts of its ranked masks; DARE's merge), and `block` merges a block of it
  with one call of the jitted `_edit_block`; `pool` runs each model's ranking in a thread."""

  def __init__(self, base: hf.Checkpoint, tuned: Sequence[hf.Checkpoint],
               paths: Sequence[str], plan: Plan, pool: concurrent.futures.Executor):
    self.base, self.tuned, self.plan, self.pool = base, list(tuned), plan, pool
    self.paths = [base.path] + list(paths)
    self.labels = tuple(f'model_{i}' for i in range(len(tuned)))
    self.key = jax.random.PRNGKey(plan.seed)
    self.mesh = sharding.make_mesh()
    # Before anything is written: the counting passes read every tensor.
    self.rankings = ([_GlobalRanking(base, ckpt, sorted(base.files), _setting(plan, 'density'),
                                     _ranked(plan, label, self.key))
                      for ckpt, label in zip(self.tuned, self.labels)]
                     if plan.global_ties else None)

  def prepare(self, name: str) -> dict:
    shape, dtype = self.base.header(name)
    for path, ckpt in zip(self.paths[1:], self.tuned):
      theirs = ckpt.header(name)
      if theirs != (shape, dtype):
        raise UserError(f'{path}: {name} is {theirs[1]}{list(theirs[0])}, the base '
                        f'{dtype}{list(shape)}')
    size = math.prod(shape)
    state = {'name': name, 'dtype': dtype}
    if not jnp.issubdtype(dtype, jnp.floating):
      state['copy'] = True  # integer buffers (position ids, masks) are not weights
    elif self.plan.method in _OP_BY_OP:
      state['merged'] = self._merge_whole(name, shape)
    elif self.plan.method in _RANKED:
      state['cuts'] = self._ranked_cuts(name, size)
    return state

  def _magnitudes(self, name: str, size: int, model: int) -> np.ndarray:
    """|τ| of one model's tensor, flat, in float32 (the values the merge's masks compare), in
    an array of this thread's that the next call overwrites."""
    # Grown to the largest tensor: a new array per tensor would be faulted in page by page,
    # and faults in parallel threads wait on each other.
    if getattr(_buffers, 'magnitudes', np.empty(0)).size < size:
      _buffers.magnitudes = np.empty(size, np.float32)
    out = _buffers.magnitudes[:size]
    _, dtype = self.base.header(name)
    for start, stop in blocks(size):
      theta, theta0 = read_block([self.tuned[model], self.base], name, start, stop,
                                 stop - start, dtype)
      np.abs(_host_delta(theta, theta0, out=out[start:stop]), out=out[start:stop])
    return out

  def _ranked_cuts(self, name: str, size: int) -> list[tuple[tree_lib.Cut, ...]]:
    """Each model's cuts of its ranked masks of the tensor: TIES keeps the largest (as the
    global ranking says, with scope 'global'); Breadcrumbs the not-smallest but the largest.
    A large tensor is ranked by one pass over its blocks; what that pass cannot place (and
    every smaller tensor) is ranked whole, each model in a thread of its own (numpy releases
    the GIL)."""
    if self.rankings is not None:
      return list(self.pool.map(
          lambda i: (self.rankings[i].cut(name, self._magnitudes(name, size, i)),),
          range(len(self.tuned))))
    if self.plan.method == 'ties':
      counts = (ops.largest_count(_setting(self.plan, 'density')),)
    else:
      counts = ops.band_counts(_setting(self.plan, 'top'), _setting(self.plan, 'bottom'))
    kept = [count(size) for count in counts]
    # A count that keeps none or all of the entries reads none of them.
    found = [[tree_lib.fixed_cut(size, k) for k in kept] for _ in self.tuned]
    ranked = [j for j, cut in enumerate(found[0]) if cut is None]
    if size >= _SAMPLED and ranked:
      for row, cuts in zip(found, self._bracketed_cuts(name, size, [kept[j] for j in ranked])):
        for j, cut in zip(ranked, cuts):
          row[j] = cut

    def fill(model: int) -> tuple[tree_lib.Cut, ...]:
      if None not in found[model]:
        return tuple(found[model])
      magnitudes = self._magnitudes(name, size, model)
      return tuple(c or tree_lib.largest_cut(magnitudes, k) for c, k in zip(found[model], kept))

    return list(self.pool.map(fill, range(len(self.tuned))))

  def _bracketed_cuts(self, name: str, size: int, kept: Sequence[int]) -> list[list]:
    """Each model's cut of each kept count, from one pass over the tensor's blocks (None where
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
      base, *thetas = read_block(ckpts, name, c * step, c * step + _CLUSTER, _CLUSTER, dtype)
      for i, theta in enumerate(thetas):
        np.abs(_host_delta(theta, base), out=samples[i, c])
    bounds = np.array([[tree_lib.bracket(sample, size, k) for k in kept] for sample in samples],
                      np.float32)
    spans = blocks(size)
    halves = [spans[:len(spans) // 2], spans[len(spans) // 2:]]
    # The two halves of the pass in threads of their own, then joined in order.
    first, second = self.pool.map(lambda half: self._bracket_pass(name, half, bounds), halves)
    return [[a.join(b).cut(k) for a, b, k in zip(ones, others, kept)]
            for ones, others in zip(first, second)]

  def _bracket_pass(self, name: str, spans: Sequence[tuple[int, int]],
                    bounds: np.ndarray) -> list[list[tree_lib.Bracketed]]:
    """What the blocks `spans` of the tensor hold of each model's brackets."""
    _, dtype = self.base.header(name)
    counted = [[tree_lib.Bracketed(0, [], []) for _ in row] for row in bounds]
    for start, stop in spans:
      buffers = read_block([self.base] + self.tuned, name, start, stop, _BLOCK, dtype)
      codes = np.asarray(_bracket_block(buffers[0], buffers[1:], bounds))[:, :, :stop - start]
      for i, model_counted in enumerate(counted):
        for j, code in enumerate(codes[i]):
          where = np.flatnonzero(code == 1)
          inside = np.abs(_host_delta(buffers[i + 1][where], buffers[0][where]))
          model_counted[j] = model_counted[j].extend(np.count_nonzero(code == 2), where + start,
                                                     inside)
    return counted

  def _merge_whole(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor merged whole, op by op under its own name (DARE), flat, as written."""
    base = self.base.tensor(name)
    thetas = [c.tensor(name) for c in self.tuned]
    _check_finite(self.plan, name, self.paths,
                  [tree_lib.first_nonfinite({name: x}) is None for x in [base] + thetas])
    placed = _split(self.mesh, shape)
    theta0 = {name: jax.device_put(base, placed)}
    vectors = _task_vectors(theta0, [{name: jax.device_put(t, placed)} for t in thetas],
                            self.labels)
    keep = None
    if self.rankings is not None:
      keep = []
      for ranking, vector in zip(self.rankings, vectors):
        ranked = np.abs(ranking.ranked(name, vector.delta[name])).ravel()
        keep.append({name: tree_lib.cut_mask(ranked, ranking.cut(name, ranked)).reshape(shape)})
    edited = _edit(self.plan, theta0, vectors, self.key, keep)[name]
    return np.asarray(edited).astype(_output_dtype(self.plan, base.dtype), copy=False).ravel()

  def block(self, state: dict, start: int, stop: int) -> np.ndarray:
    name = state['name']
    if 'copy' in state:
      return self.base.read(name, start, stop)
    if 'merged' in state:
      return state['merged'][start:stop]
    buffers = read_block([self.base] + self.tuned, name, start, stop, _BLOCK, state['dtype'])
    if not self.plan.allow_nonfinite:
      _check_finite(self.plan, name, self.paths, [np.isfinite(x).all() for x in buffers])
    cuts = None
    if 'cuts' in state:
      cuts = [tuple(tree_lib.Cut(np.float32(c.threshold),
                                 np.int32(min(max(c.last - start, -1), _BLOCK)))
                    for c in model_cuts) for model_cuts in state['cuts']]
    # On one CPU device the program reads the aligned buffers in place; np.asarray waits for
    # it, after which this thread may read into them again.
    inputs = (jax.device_put(buffers, _split(self.mesh, (_BLOCK,))) if self.mesh.size > 1
              else buffers)
    edited = np.asarray(_edit_block(self.plan, inputs[0], inputs[1:], cuts))
    if any(np.may_share_memory(edited, b) for b in buffers):
      edited = edited.copy()  # an output XLA forwarded from a buffer that will be read into
    # Cast here, from the dtype as stored: JAX without x64 sees float64 as float32.
    return edited[:stop - start].astype(_output_dtype(self.plan, state['dtype']), copy=False)


_buffers = threading.local()


def read_block(ckpts: Sequence[hf.Checkpoint], name: str, start: int, stop: int, width: int,
               dtype: np.dtype) -> list[np.ndarray]:
  """Entries [start, stop) of the tensor `name` of each checkpoint, zero-padded to `width`, in
  buffers of this thread's that the next call reads into again: they stay in the processor's
  cache, and are aligned to 64 bytes, which JAX's CPU client takes without a copy."""
  if width < stop - start:
    raise ValueError(f'{name}: a block of {stop - start} entries does not fit in {width}')
  buffers = getattr(_buffers, 'reads', [])
  if len(buffers) < len(ckpts) or buffers[0].dtype != dtype or buffers[0].size < width:
    _buffers.reads = buffers = [_aligned(max(width, _BLOCK), dtype) for _ in ckpts]
  for ckpt, buffer in zip(ckpts, buffers):
    ckpt.read(name, start, stop, out=buffer)
    buffer[stop - start:width] = 0
  return [b[:width] for b in buffers[:len(ckpts)]]


def _aligned(size: int, dtype: np.dtype) -> np.ndarray:
  raw = np.empty(size * dtype.itemsize + 64, np.uint8)
  offset = -raw.ctypes.data % 64
  return raw[offset:offset + size * dtype.itemsize].view(dtype)


def _host_delta(theta: np.ndarray, base: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
  """τ = θ − θ0 in float32 on the host (into `out`, if given), the values the host rankings
  read."""
  return np.subtract(theta.astype(np.float32, copy=False), base.astype(np.float32, copy=False),
                     out=out)


def _setting(plan: Plan, key: str):
  """The plan's value of a setting of its method, else the method's own default."""
  if key in plan.settings:
    return plan.settings[key]
  return inspect.signature(merging.get(plan.method).merge).parameters[key].default


def _check_finite(plan: Plan, name: str, paths: Sequence[str], finite: Sequence[bool]) -> None:
  """An error naming the first input whose tensor `name` holds a NaN or an infinity, unless the
  plan allows them."""
  for path, ok in zip(paths, finite):
    if not ok and not plan.allow_nonfinite:
      raise UserError(f'{path}: {name} holds non-finite values (NaN or infinity); pass '
                      'allow_nonfinite to merge it anyway')


@functools.partial(jax.jit, static_argnums=0)
def _edit_block(plan: Plan, base: jax.Array, thetas: list, cuts: list | None) -> jax.Array:
  """One block's edit as one XLA program, compiled once per dtype (the block
  is the one leaf `_LEAF`, whatever its tensor): what `_edit` makes of it, the masks a method
  ranks drawn from their cuts (relative to the block)."""
  vectors = _task_vectors({_LEAF: base}, [{_LEAF: t} for t in thetas],
                          [f'model_{i}' for i in range(len(thetas))])
  keep = None
  if cuts is not None:
    keep = []
    for vector, model_cuts in zip(vectors, cuts):
      masks = [tree_lib.cut_mask(jnp.abs(vector.delta[_LEAF]), c) for c in model_cuts]
      keep.append({_LEAF: masks[0] if len(masks) == 1 else masks[0] & ~masks[1]})
  return _edit(plan, {_LEAF: base}, vectors, None, keep)[_LEAF]


@jax.jit
def _bracket_block(base: jax.Array, thetas: list, bounds: jax.Array) -> jax.Array:
  """Per model and bracket (bounds[model, bracket] = lower, upper), each entry of a block: 0
  where |τ| lies below the bracket, 1 inside it, 2 above it (int8)."""
  magnitudes = jnp.stack([jnp.abs(jnp.asarray(t, jnp.float32) - jnp.asarray(base, jnp.float32))
                          for t in thetas])[:, None, :]
  lower, upper = bounds[:, :, :1], bounds[:, :, 1:]
  return (magnitudes >= lower).astype(jnp.int8) + (magnitudes > upper).astype(jnp.int8)


def _split(mesh: jax.sharding.Mesh, shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
  """An array's placement: its first dimension that the device count divides is split over all
  devices (every method is elementwise or ranks on the host, so the bits do not change), or
  it is replicated."""
  for d, size in enumerate(shape):
    if size % mesh.size == 0:
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
          *[None] * d, sharding.MESH_AXES))
  return sharding.replicated(mesh)


def _task_vectors(theta0: dict, tuned: Sequence[dict], labels: Sequence[str]) -> list:
  """τ_t = θ_t − θ0 in float32, one vector per fine-tuned model, over θ0's names."""
  return [TaskVector({n: jnp.asarray(theta[n], jnp.float32) - jnp.asarray(x, jnp.float32)
                      for n, x in theta0.items()}, (label,), 'full', 'streamed')
          for theta, label in zip(tuned, labels)]


def _edit(plan: Plan, theta0: dict, vectors: list, key: jax.Array, keep=None) -> dict:
  """What `plan` makes of θ0 (floating tensors) and the task vectors over it: τ_1 (extract),
  θ0 − λ·τ_1 (negation), or θ0 + λ·merge(τ_1..τ_N); `keep`, the masks ranked beforehand."""
  if plan.method == 'extract':
    return dict(vectors[0].delta)
  if plan.method == 'negation':
    merged, scale = vectors[0], -plan.scale
  else:
    method = merging.get(plan.method)
    reads = {'key': key} if 'key' in method.reads else {}
    if plan.weights is not None:
      reads['weights'] = list(plan.weights)
    if keep is not None:
      reads['keep'] = keep
    merged, scale = method.merge(vectors, **reads, **plan.settings), plan.scale
  return merged.apply_to(theta0, scale)


def _finish(base: str, partial: str, output: str, shards: list[dict]) -> None:
  if len(shards) > 1:
    index = {'metadata': {'total_size': sum(s['bytes'] for s in shards)},
             'weight_map': {n: s['file'] for s in shards for n in s['names']}}
    checkpoint.atomic_write_json(os.path.join(partial, hf.INDEX), index)
  if os.path.isdir(base):
    for name in _COPIED:
      if os.path.exists(os.path.join(base, name)):
        shutil.copy(os.path.join(base, name), os.path.join(partial, name))
  if os.path.exists(output):
    shutil.rmtree(output)
  os.replace(partial, output)
  logging.info('merged checkpoint in %s', output)


def in_memory(base: str, models: Sequence[str], plan: Plan) -> dict[str, np.ndarray]:
  """The same merge over whole models at once, ranking inside it: the reference the streamed
  result must equal. Jitted as the streamed merge is (DARE op by op, as it is there): XLA
  contracts a·b + c into one fused multiply-add and divides by a constant as a multiply by its
  reciprocal, so an op-by-op merge and a jitted one may differ in the last bit."""
  base_ckpt = hf.Checkpoint(base)
  stored = {n: base_ckpt.tensor(n) for n in base_ckpt.files}
  floats = {n: jnp.asarray(x) for n, x in stored.items() if jnp.issubdtype(x.dtype, jnp.floating)}
  tuned = [{n: ckpt.tensor(n) for n in floats} for ckpt in map(hf.Checkpoint, models)]
  labels = [f'model_{i}' for i in range(len(models))]
  edit = _edit if plan.method in _OP_BY_OP else jax.jit(_edit, static_argnums=0)
  edited = edit(plan, floats, _task_vectors(floats, tuned, labels), jax.random.PRNGKey(plan.seed))
  return {**stored, **{n: np.asarray(x).astype(_output_dtype(plan, stored[n].dtype), copy=False)
                       for n, x in edited.items()}}


def read_output(output: str) -> dict[str, np.ndarray]:
  ckpt = hf.Checkpoint(output)
  return {n: ckpt.tensor(n) for n in ckpt.files}


def run(config, workdir: str) -> dict:
  """The launch job: `config` as configs/merge_checkpoints.py describes it (or the mergekit
  YAML `config.mergekit` names); the output defaults to <workdir>/merged."""
  if config.mergekit:
    config = mergekit.apply(config, config.mergekit)
  models = [m.strip() for m in config.models.split(',') if m.strip()]
  section = config.get(config.method)
  try:
    weights = (tuple(float(w) for w in config.weights.split(',')) if config.weights.strip()
               else None)
  except ValueError:
    raise UserError(f'config.weights = {config.weights!r}: comma-separated numbers, one per '
                    'model') from None
  plan = Plan(config.method, section.to_dict() if section is not None else {},
              scale=config.scale, seed=config.seed, shard_bytes=config.shard_bytes,
              allow_nonfinite=config.allow_nonfinite, weights=weights,
              dtype=config.dtype or None, prefetch=config.prefetch)
  if not config.base:
    raise UserError('config.base: give the base checkpoint (a Hugging Face directory or a '
                    '.safetensors file)')
  return merge(config.base, models, config.output or os.path.join(workdir, 'merged'), plan)
