"""Fixed-shape batches over a dataset of any length: one compiled program serves every batch.

The last batch is padded with zeros to the full size; `weights` marks the real rows (1) and the
padding (0), so a sum over the batch can weight the padding out and an output can be cut back
to `count` rows. Given `multiple`, the last batch is padded only to the smallest halving of the
size (size, size/2, size/4, ..., whole multiples of `multiple`, at least `SMALLEST` rows) that
holds it: a few more compiles, once each, instead of a mostly padded batch for a small dataset.
"""

from typing import Iterator, NamedTuple, Sequence

import numpy as np


class Batch(NamedTuple):
  arrays: list[np.ndarray]  # each of `size` rows, zero-padded
  weights: np.ndarray  # (size,) float32: 1 on real rows, 0 on padding
  count: int  # the real rows, first in the batch


SMALLEST = 32


def last_batch_size(count: int, size: int, multiple: int) -> int:
  """The smallest of size, size/2, size/4, ... (whole multiples of `multiple`, at least
  SMALLEST, or `size` itself) that holds `count` rows."""
  best = size
  while best % 2 == 0 and best // 2 >= max(count, SMALLEST) and (best // 2) % multiple == 0:
    best //= 2
  return best


def padded_batches(arrays: Sequence[np.ndarray], size: int,
                   multiple: int | None = None) -> Iterator[Batch]:
  """Consecutive batches of `size` rows of the equally long `arrays`, the last one padded (to
  `last_batch_size` given `multiple`, else to `size`)."""
  total = len(arrays[0])
  if any(len(a) != total for a in arrays):
    raise ValueError(f'arrays of lengths {[len(a) for a in arrays]} cannot be batched together')
  for start in range(0, total, size):
    count = min(size, total - start)
    rows = size if multiple is None else last_batch_size(count, size, multiple)
    padded = []
    for a in arrays:
      chunk = np.zeros((rows,) + a.shape[1:], a.dtype)
      chunk[:count] = a[start:start + count]
      padded.append(chunk)
    yield Batch(padded, (np.arange(rows) < count).astype(np.float32), count)
