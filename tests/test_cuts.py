"""The ranking engine against a stable descending argsort, on every dtype it ranks and on the
values that break a select by bits: signed zeros, NaN, infinities, ties across chunks."""

import hypothesis
import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import pytest

from editing import cuts

DTYPES = (np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.uint8)


def argsort_mask(values: np.ndarray, kept: int) -> np.ndarray:
  """The kept largest as a stable descending argsort keeps them, NaN above everything."""
  wide = values.astype(np.float64) if values.dtype.kind != 'i' else values.astype(np.int64)
  order = np.argsort(-wide, kind='stable')
  if values.dtype.kind not in 'iu':
    order = np.concatenate([np.flatnonzero(np.isnan(wide)), order[~np.isnan(-wide[order])]])
  mask = np.zeros(values.size, bool)
  mask[order[:max(kept, 0)]] = True
  return mask & ~np.isnan(wide)  # a NaN ranks above all but, comparing false, is never kept


def values_of(kind: str, dtype, n: int, rng: np.random.Generator) -> np.ndarray:
  if np.dtype(dtype).kind in 'iu':
    return rng.integers(0, 7, n).astype(dtype) if kind != 'normal' else rng.integers(
        np.iinfo(dtype).min, np.iinfo(dtype).max, n, dtype=dtype)
  peaks = rng.random(n) + 10 * (np.arange(n) % 2 == 0)
  return {'normal': rng.standard_normal(n),
          'peaks_on_the_stride': peaks,
          'few_values': rng.integers(-2, 3, n).astype(float),
          'specials': rng.choice([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan], n),
          }[kind].astype(dtype)


@pytest.mark.parametrize('dtype', DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize('kind', ['normal', 'few_values', 'specials', 'peaks_on_the_stride'])
@pytest.mark.parametrize('sampled', [False, True], ids=['counted', 'sampled'])
def test_largest_cut_keeps_what_a_stable_argsort_keeps(dtype, kind, sampled, monkeypatch):
  """Chunks of 64 entries, so that ties and the kept-th largest span chunks; sampled, every
  array of 100 or more is bracketed by a strided sample (every second entry here), which the
  peaks on its stride fool: the counts notice, and the two passes run."""
  monkeypatch.setattr(cuts, '_CHUNK', 64)
  monkeypatch.setattr(cuts, '_SAMPLED', 100 if sampled else 1 << 62)
  missed = []
  resolve = cuts._resolve  # pylint: disable=protected-access
  monkeypatch.setattr(cuts, '_resolve', lambda *args: [
      missed.append(s is None) or s for s in resolve(*args)])
  rng = np.random.default_rng(0)
  for n in (1, 7, 200, 1000):
    values = values_of(kind, dtype, n, rng)
    counts = sorted({0, 1, n // 3, n // 2, n - 1, n, n + 1})
    for kept in counts:
      np.testing.assert_array_equal(cuts.cut_mask(values, cuts.largest_cut(values, kept)),
                                    argsort_mask(values, kept), err_msg=(n, kept))
    # Every count at once, in one set of passes.
    for kept, cut in zip(counts, cuts.largest_cuts(values, counts)):
      np.testing.assert_array_equal(cuts.cut_mask(values, cut), argsort_mask(values, kept),
                                    err_msg=(n, kept, 'together'))
  if sampled and kind == 'peaks_on_the_stride' and np.dtype(dtype).kind == 'f':
    assert any(missed), 'the sample was not fooled'
  if sampled and kind == 'normal' and dtype in (np.float32, np.float64):
    assert not any(missed), 'a sample of distinct values missed its bracket'


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.lists(st.floats(width=32, allow_nan=False), min_size=2, max_size=300),
                  st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_select_finds_each_count_in_one_set_of_passes(entries, chunk_sizes, data):
  """Several counts found together, the chunks of uneven sizes: per chunk, the ties kept are
  the earliest, and each chunk's cut, computed alone, keeps its part of the argsort's mask."""
  values = np.array(entries, np.float32)
  bounds = np.cumsum(chunk_sizes * (len(values) // sum(chunk_sizes) + 1))
  starts = [0] + [int(b) for b in bounds if b < values.size]
  pieces = np.split(values, starts[1:])
  kept = data.draw(st.lists(st.integers(1, values.size - 1), min_size=1, max_size=3))
  passes = []

  def chunks():
    passes.append(None)
    return iter(pieces)

  for count, selection in zip(kept, cuts.select(chunks, np.float32, values.size, kept)):
    want = argsort_mask(values, count)
    got = np.concatenate([cuts.cut_mask(p, selection.cut(i, p)) for i, p in enumerate(pieces)])
    np.testing.assert_array_equal(got, want, err_msg=count)
    whole = cuts.whole_cut(selection, starts, lambda i: pieces[i])
    np.testing.assert_array_equal(cuts.cut_mask(values, whole), want)
  assert len(passes) == 2, 'float32 is two 16-bit digits: two passes, whatever the counts'


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.lists(st.floats(-4, 4, width=32).map(lambda x: round(x, 1)), min_size=1,
                           max_size=200), st.integers(1, 4), st.data())
def test_largest_values_are_the_sorted_entries_at_their_counts(entries, pieces, data):
  """The k-th largest for each k from 1 to n (the smallest among them), counts repeated and in
  any order, over uneven chunks, many of the values tied: np.sort's entry at n − k."""
  values = np.array(entries, np.float32)
  chunks = [c for c in np.array_split(values, pieces) if c.size]
  counts = data.draw(st.lists(st.integers(1, values.size), min_size=1, max_size=5))
  found = cuts.largest_values(lambda: iter(chunks), np.float32, values.size, counts)
  assert found == [np.sort(values)[values.size - k] for k in counts]


def test_keys_order_as_the_values_do():
  """Every bfloat16 bit pattern: its key's order is the values' order, −0 equal to +0, and
  every NaN above +∞."""
  values = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
  keys = cuts.keys(values)
  finite = ~np.isnan(values)
  by_value = np.argsort(values[finite].astype(np.float64), kind='stable')
  ordered = keys[finite][by_value]
  assert (np.diff(ordered.astype(np.int64)) >= 0).all()
  wide = values[finite].astype(np.float64)[by_value]
  assert ((np.diff(ordered.astype(np.int64)) == 0) == (np.diff(wide) == 0)).all()
  assert (keys[~finite] > keys[finite].max()).all()
  for key in np.unique(keys[finite]):
    assert cuts.keys(np.array([cuts.value_of(int(key), ml_dtypes.bfloat16)],
                              ml_dtypes.bfloat16))[0] == key
