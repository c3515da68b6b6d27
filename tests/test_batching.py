"""Fixed-shape batches: every row once, in order, and a last batch padded only as far as
needed."""

import numpy as np
import pytest

from editing import batching


@pytest.mark.parametrize('total,size,multiple,last', [
    (1000, 512, 1, 512),  # 488 rows left: no halving holds them
    (600, 512, 1, 128),  # 88 rows: 512 → 256 → 128
    (10, 512, 1, 32),  # never below SMALLEST
    (520, 512, 16, 32),
    (530, 512, 64, 64),  # 18 rows, but a batch must split over 64 devices
    (10, 48, 1, 48),  # 48 → 24 is below SMALLEST
    (5, 8, None, 8),  # no multiple: always the full size
])
def test_the_last_batch_is_the_smallest_halving_that_holds_it(total, size, multiple, last):
  batches = list(batching.padded_batches([np.arange(total)], size, multiple=multiple))
  assert [len(b.arrays[0]) for b in batches[:-1]] == [size] * (len(batches) - 1)
  assert len(batches[-1].arrays[0]) == last
  rows = np.concatenate([b.arrays[0][:b.count] for b in batches])
  np.testing.assert_array_equal(rows, np.arange(total))
  assert all(b.weights.sum() == b.count for b in batches)
