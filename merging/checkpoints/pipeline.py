"""The block pipeline of a streamed merge: tensors read a block at a time into reused buffers,
merged in threads ahead of the one being written, and written as they come."""

import collections
import concurrent.futures
import contextlib
import math
import os
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from editing import safetensors_io
from editing.models import hf

# Entries per block: a block of each of the N + 1 inputs (1 MB each in float32) stays in the
# processor's cache from its read to its write.
BLOCK = 1 << 18

# Tensors prepared (the rankings of a method's cuts), two at a time, ahead of the one being
# merged, so that the ranking threads keep busy through a run of small tensors.
_PREPARED_AHEAD, _PREPARING = 3, 2


def blocks(size: int, width: int | None = None) -> list[tuple[int, int]]:
  """The blocks [start, stop) of a tensor of `size` entries, each merged by one program call:
  (N + 1) inputs of a block (of `width` entries, BLOCK unless given) stay in the processor's
  cache while they are read, merged and written."""
  width = width or BLOCK
  return [(b, min(size, b + width)) for b in range(0, size, width)]


def write_shards(partial, shards: Sequence[safetensors_io.Shard], prepare: Callable[[str], Any],
                 block: Callable[[Any, int, int], np.ndarray], depth: int) -> None:
  """Each shard not yet in `partial` (an `output.Partial`) written by `write_streamed` and
  recorded done, then the index of them all."""
  for shard in shards:
    if not partial.has(shard.file):
      write_streamed(os.path.join(partial.path, shard.file), shard.entries, prepare, block, depth)
      partial.shard_done()
  safetensors_io.write_index(partial.path, shards)


class Phases:
  """The seconds a streamed merge spends in each phase (`timed`), summed over the threads that
  run it: reads, merges and writes overlap, so their sum may pass the wall time."""

  def __init__(self):
    self.seconds = collections.Counter()
    self._lock = threading.Lock()

  def add(self, phase: str, seconds: float) -> None:
    with self._lock:
      self.seconds[phase] += seconds

  @contextlib.contextmanager
  def timed(self, phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
      yield
    finally:
      self.add(phase, time.perf_counter() - start)


def write_streamed(path: str, entries: list[tuple[str, tuple[int, ...], np.dtype]],
                   prepare: Callable[[str], Any], block: Callable[[Any, int, int], np.ndarray],
                   depth: int, spans: Callable[[Any, int], list] | None = None,
                   phases: Phases | None = None) -> None:
  """The safetensors file `path` of `entries`, each tensor written a block at a time: the
  tensors' prepare(name) calls run in threads, _PREPARING at a time, up to _PREPARED_AHEAD
  tensors ahead of the one being written, and a tensor's block(prepared, start, stop) calls
  (1-D arrays of the entry's dtype) run `depth` ahead in threads while the caller writes the
  current one. File reads, numpy and XLA release the GIL, so reads, merges and writes overlap;
  in memory are the blocks in flight and what prepare keeps of _PREPARED_AHEAD + 1 tensors
  (for the whole-tensor merges, each one merged whole). spans(prepared, size) gives a tensor's
  blocks where they are not `blocks(size)`'s; `phases` is given the writer's time ('write':
  from each block's handing over to the writer to its asking for the next)."""
  sizes = {name: math.prod(shape) for name, shape, _ in entries}
  with pool(_PREPARING) as preparing, pool(depth) as merges:
    prepared = ahead(prepare, list(sizes), _PREPARED_AHEAD, preparing)

    def chunks(name: str) -> Iterator[np.ndarray]:
      state = next(prepared)
      spanned = spans(state, sizes[name]) if spans else blocks(sizes[name])
      for chunk in ahead(lambda span: block(state, *span), spanned, depth, merges):
        handed = time.perf_counter()
        yield chunk
        if phases is not None:
          phases.add('write', time.perf_counter() - handed)

    safetensors_io.write(path, entries, chunks, metadata=hf.PT_METADATA)


@contextlib.contextmanager
def pool(workers: int) -> Iterator[concurrent.futures.ThreadPoolExecutor]:
  """Threads that live as long as the block (the merge's read buffers are theirs); after an
  error or an interrupt, the work not yet started is dropped, not run."""
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
  try:
    yield pool
  finally:
    pool.shutdown(wait=True, cancel_futures=True)


def ahead(produce: Callable[[Any], Any], items: Sequence, depth: int,
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


# Each thread's buffers: its read blocks, and the magnitudes a ranking reads whole.
thread_buffers = threading.local()


def read_block(ckpts: Sequence[hf.Reader], name: str, start: int, stop: int, width: int,
               dtype: np.dtype) -> list[np.ndarray]:
  """Entries [start, stop) of the tensor `name` of each checkpoint, zero-padded to `width`, in
  buffers of this thread's that the next call reads into again: they stay in the processor's
  cache, and are aligned to 64 bytes, which JAX's CPU client takes without a copy."""
  if width < stop - start:
    raise ValueError(f'{name}: a block of {stop - start} entries does not fit in {width}')
  buffers = getattr(thread_buffers, 'reads', [])
  if len(buffers) < len(ckpts) or buffers[0].dtype != dtype or buffers[0].size < width:
    thread_buffers.reads = buffers = [_aligned(max(width, BLOCK), dtype) for _ in ckpts]
  for ckpt, buffer in zip(ckpts, buffers):
    ckpt.read(name, start, stop, out=buffer)
    buffer[stop - start:width] = 0
  return [b[:width] for b in buffers[:len(ckpts)]]


def _aligned(size: int, dtype: np.dtype) -> np.ndarray:
  raw = np.empty(size * dtype.itemsize + 64, np.uint8)
  offset = -raw.ctypes.data % 64
  return raw[offset:offset + size * dtype.itemsize].view(dtype)


def host_delta(theta: np.ndarray, base: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
  """τ = θ − θ0 in float32 on the host (into `out`, if given), the values the host rankings
  read."""
  return np.subtract(theta.astype(np.float32, copy=False), base.astype(np.float32, copy=False),
                     out=out)

