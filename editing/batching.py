"""Fixed-shape batches over a dataset of any length: one compiled program serves every batch.

The last batch is padded with zeros to the full size; `weights` marks the real rows (1) and the
padding (0), so a sum over the batch can weight the padding out and an output can be cut back
to `count` rows.
"""

from typing import Iterator, NamedTuple, Sequence

import numpy as np


class Batch(NamedTuple):
  arrays: list[np.ndarray]  # each of `size` rows, zero-padded
  weights: np.ndarray  # (size,) float32: 1 on real rows, 0 on padding
  count: int  # the real rows, first in the batch


def padded_batches(arrays: Sequence[np.ndarray], size: int) -> Iterator[Batch]:
  """Consecutive batches of `size` rows of the equally long `arrays`, the last one padded."""
  total = len(arrays[0])
  if any(len(a) != total for a in arrays):
    raise ValueError(f'arrays of lengths {[len(a) for a in arrays]} cannot be batched together')
  for start in range(0, total, size):
    count = min(size, total - start)
    padded = []
    for a in arrays:
      chunk = np.zeros((size,) + a.shape[1:], a.dtype)
      chunk[:count] = a[start:start + count]
      padded.append(chunk)
    yield Batch(padded, (np.arange(size) < count).astype(np.float32), count)
