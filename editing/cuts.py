"""The k largest entries of an array, exactly, seen one chunk at a time: the one ranking engine
of the in-memory top-k (`editing.tree.top_k`), of a streamed tensor and of a streamed model's
global top-k (`merging.checkpoints.ranking`).

A `Cut` says what is kept in two numbers: the entries above a threshold, and those equal to it
up to an index (ties go to the earlier entry, as a stable descending argsort keeps them).

`select` finds it from keys: each value maps to an unsigned integer of its width that orders as
the values do (−0 as +0, every NaN above +∞, where numpy's sort places NaN). One pass over the
chunks counts the entries above a range of keys and tallies, per chunk, the distinct keys inside
it; if the kept-th largest lies inside, those tallies say which key it is and how many of its
ties each chunk holds, so that each chunk's cut is computed on its own. The range is the bucket
of the kept-th largest key's top 16 bits, which a first pass finds by counting every entry's
top 16 bits (a histogram of 2^16 counts, whatever the array's size; a float32 bucket holds at
most 2^16 distinct keys, a float64 one as many as its entries): exact in two passes. Or,
given a sample of the values, it is a few standard errors of the sampled share either side of
the sample's kept-th largest: one pass, and where the counts say the range missed, the two
passes run.
"""

import math
from typing import Callable, Iterable, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

_DIGIT = 16  # bits of the first pass's digit


class Cut(NamedTuple):
  """A top-k mask of a 1-D array in two numbers: the entries above `threshold`, and those equal
  to it up to index `last`. It is evaluated on any slice of the array (`cut_mask`), so an array
  ranked once is masked a block at a time."""

  threshold: float
  last: int


def fixed_cut(n: int, kept: int) -> Cut | None:
  """The cut of the `kept` largest of n entries where it keeps none or all of them, whatever
  their values; None where it depends on them."""
  if kept <= 0:
    return Cut(math.inf, -1)
  if kept >= n:
    return Cut(-math.inf, n - 1)
  return None


def cut_at(threshold: float, equal: np.ndarray, room: int) -> Cut:
  """The cut keeping the entries above `threshold` and the first `room` of those equal to it
  (`equal`, their mask in order)."""
  ties = np.flatnonzero(equal)[:max(room, 0)]
  return Cut(threshold, int(ties[-1]) if ties.size else -1)


def cut_mask(values, cut: Cut):
  """The mask `cut` keeps of `values`: numpy on the host, or traced in jnp on a block of the
  ranked array (with `cut.last` counted from the block's first entry)."""
  above = values > cut.threshold
  if isinstance(values, np.ndarray):
    if cut.last >= 0:
      above[np.flatnonzero(values[:cut.last + 1] == cut.threshold)] = True
    return above
  return above | ((values == cut.threshold) & (jnp.arange(values.size) <= cut.last))


class Selection(NamedTuple):
  """What `select` found for one count: the kept-th largest `value`, and per chunk, how many of
  its entries equal to it are kept (`room[i]`, the earliest ones of chunk i)."""

  value: float
  room: tuple[int, ...]

  def cut(self, index: int, chunk: np.ndarray) -> Cut:
    """The cut of chunk `index` (`chunk`, its values), positions counted within it."""
    return cut_at(self.value, chunk.ravel() == self.value, self.room[index])


def select(passes: Callable[[], Iterable[np.ndarray]], dtype, size: int, kept: Sequence[int],
           sample: np.ndarray | None = None) -> list[Selection]:
  """For each count in `kept` (from 1 to `size` − 1), the `Selection` of that many largest of
  the `size` entries of the chunks that each call of `passes()` yields, in order, all of one
  `dtype`; `sample`, some of their values drawn evenly, spares a pass when it brackets well."""
  dtype = np.dtype(dtype)
  found = [None] * len(kept)
  if sample is not None:
    sampled = np.sort(keys(sample.ravel()))
    found = _resolve(_count(passes, [_bracket(sampled, size, k) for k in kept]), kept, dtype)
  missed = [t for t, selection in enumerate(found) if selection is None]
  if missed:
    shift = max(8 * dtype.itemsize - _DIGIT, 0)
    top = np.zeros(1 << (8 * dtype.itemsize - shift), np.int64)
    for chunk in passes():
      key = keys(chunk.ravel())
      # Shifted straight into the index type bincount counts: one pass, not three.
      top += np.bincount(np.right_shift(key, shift, out=np.empty(key.size, np.intp),
                                        casting='unsafe'), minlength=top.size)
    from_top = np.cumsum(top[::-1])
    buckets = [top.size - 1 - int(np.searchsorted(from_top, kept[t])) for t in missed]
    ranges = [(b << shift, ((b + 1) << shift) - 1) for b in buckets]
    for t, selection in zip(missed, _resolve(_count(passes, ranges),
                                             [kept[t] for t in missed], dtype)):
      found[t] = selection
  return found


def _bracket(sampled: np.ndarray, size: int, kept: int) -> tuple[int, int]:
  """The range of keys six standard errors of the sampled share either side of the sorted
  sample's kept-th largest key (open where it passes the sample's ends)."""
  m, share = sampled.size, kept / size
  slack = 6 * math.sqrt(share * (1 - share) / m) + 2 / m
  low, high = math.floor((1 - share - slack) * m), math.ceil((1 - share + slack) * m)
  return (int(sampled[low]) if low > 0 else 0,
          int(sampled[high]) if high < m - 1 else np.iinfo(sampled.dtype).max)


def _count(passes: Callable[[], Iterable[np.ndarray]], ranges: Sequence[tuple[int, int]]):
  """Per range [low, high] of keys, one pass's count of the entries above it and, per chunk,
  the distinct keys inside it with how often each occurs."""
  above = [0] * len(ranges)
  inside = [[] for _ in ranges]
  for chunk in passes():
    key = keys(chunk.ravel())
    for r, (low, high) in enumerate(ranges):
      above[r] += int(np.count_nonzero(key > high))
      inside[r].append(np.unique(key[(key >= low) & (key <= high)], return_counts=True))
  return list(zip(above, inside))


def _resolve(counted, kept: Sequence[int], dtype) -> list:
  """The `Selection` of each count from what `_count` found of its range; None where the
  kept-th largest lies outside the range."""
  selections = []
  for (above, per_chunk), count in zip(counted, kept):
    distinct, where = np.unique(np.concatenate([k for k, _ in per_chunk]), return_inverse=True)
    times = np.zeros(distinct.size, np.int64)
    np.add.at(times, where, np.concatenate([t for _, t in per_chunk]))
    from_top = np.cumsum(times[::-1])
    if above >= count or above + (int(from_top[-1]) if from_top.size else 0) < count:
      selections.append(None)
      continue
    index = int(np.searchsorted(from_top, count - above))
    key = int(distinct[distinct.size - 1 - index])
    left = count - above - (int(from_top[index - 1]) if index else 0)
    room = []
    for keys_in, times_in in per_chunk:
      room.append(min(int(times_in[keys_in == key].sum()), left))
      left -= room[-1]
    selections.append(Selection(value_of(key, dtype), tuple(room)))
  return selections


def keys(values: np.ndarray) -> np.ndarray:
  """Unsigned integers of the values' width that order as the 1-D `values` do: for floats their
  bits with the sign folded (negatives reversed below the positives), −0 as +0, NaN the
  largest; for integers their offset from the type's minimum."""
  unsigned = np.dtype(f'uint{8 * values.dtype.itemsize}')
  sign = unsigned.type(1 << (8 * values.dtype.itemsize - 1))
  if values.dtype.kind == 'u':
    return values
  if values.dtype.kind == 'i':
    return values.view(unsigned) ^ sign
  if not np.signbit(values).any():
    return values.view(unsigned) | sign  # magnitudes, the usual case: one operation
  with np.errstate(invalid='ignore'):  # a signalling NaN, made quiet: it is set below
    bits = np.add(values, values.dtype.type(0)).view(unsigned)  # −0 + 0 is +0
  key = bits ^ ((bits >> (8 * values.dtype.itemsize - 1)) * (sign - 1) | sign)
  nan = np.isnan(values)
  if nan.any():
    key[nan] = np.iinfo(unsigned).max
  return key


def value_of(key: int, dtype) -> float:
  """The value of `dtype` whose key (`keys`) is `key` (a NaN for the largest float key)."""
  dtype = np.dtype(dtype)
  unsigned = np.dtype(f'uint{8 * dtype.itemsize}')
  sign = 1 << (8 * dtype.itemsize - 1)
  if dtype.kind == 'u':
    return np.array(key, unsigned).item()
  if dtype.kind == 'i':
    return np.array(key ^ sign, unsigned).view(dtype).item()
  bits = key ^ sign if key & sign else ~key & ((sign << 1) - 1)
  return np.array(bits, unsigned).view(dtype).item()


def whole_cut(selection: Selection, starts: Sequence[int],
              chunk: Callable[[int], np.ndarray]) -> Cut:
  """The cut of the whole array in which `selection` was found, its chunks starting at
  `starts`: the ties it keeps end in the last chunk with room, whose values `chunk(i)` reads
  again."""
  last = max((i for i, room in enumerate(selection.room) if room), default=None)
  if last is None:
    return Cut(selection.value, -1)
  found = selection.cut(last, chunk(last))
  return Cut(found.threshold, starts[last] + found.last)


def chunked_cuts(chunk: Callable[[int], np.ndarray], starts: Sequence[int], dtype, size: int,
                 kept: Sequence[int], sample: np.ndarray | None = None) -> list[Cut]:
  """The cut of each count in `kept` (from 1 to `size` − 1) of the `size` entries of an array
  read a chunk at a time, chunk i by `chunk(i)`, from entry `starts[i]` on: `select`, then the
  chunk whose ties it keeps last read again (`whole_cut`)."""
  selections = select(lambda: map(chunk, range(len(starts))), dtype, size, kept, sample)
  return [whole_cut(selection, starts, chunk) for selection in selections]


def largest_values(passes: Callable[[], Iterable[np.ndarray]], dtype, size: int,
                   counts: Sequence[int], sample: np.ndarray | None = None) -> list[float]:
  """The k-th largest of the `size` entries of the chunks each call of `passes()` yields, for
  each k in `counts` (from 1 to `size`): by `select`, the smallest (k = `size`) by a pass of
  its own."""
  ranked = sorted({k for k in counts if k < size})
  found = dict(zip(ranked, (selection.value for selection in
                            select(passes, dtype, size, ranked, sample)))) if ranked else {}
  if size in counts:
    found[size] = min(chunk.min() for chunk in passes())
  return [found[k] for k in counts]


def largest_cut(values: np.ndarray, kept: int) -> Cut:
  """The cut of the `kept` largest of a 1-D numpy array, exactly as a stable descending
  argsort keeps them (none for kept ≤ 0, every non-NaN entry for kept ≥ the size); NaN ranks
  above everything (and, comparing false, is never kept)."""
  return largest_cuts(values, [kept])[0]


def largest_cuts(values: np.ndarray, kept: Sequence[int]) -> list[Cut]:
  """`largest_cut` of each count, all found in one set of passes. Ranked in chunks that stay
  in the cache; a large array's sample is strided (a prime stride, so no row length aligns
  with it)."""
  found = [fixed_cut(values.size, k) for k in kept]
  ranked = [i for i, cut in enumerate(found) if cut is None]
  if ranked:
    starts = range(0, values.size, _CHUNK)
    sample = values[::sample_stride(values.size)] if values.size >= _SAMPLED else None
    for i, cut in zip(ranked, chunked_cuts(lambda i: values[starts[i]:starts[i] + _CHUNK],
                                           starts, values.dtype, values.size,
                                           [kept[i] for i in ranked], sample)):
      found[i] = cut
  return found


_CHUNK = 1 << 18
_SAMPLED = 1 << 20


def sample_stride(size: int) -> int:
  """The stride of an even sample of about 2^16 of `size` entries: a prime, so that no row
  length aligns with it."""
  return _prime_at_least(size >> 16)


def _prime_at_least(k: int) -> int:
  k = max(k, 2)
  while any(k % d == 0 for d in range(2, math.isqrt(k) + 1)):
    k += 1
  return k
