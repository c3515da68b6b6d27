"""How a streamed merge keeps what a method's scores select (`merging.Method.scores`,
`merging.sparsity.Scores`): a tensor's scores computed on the host a block at a time (of whole
rows, where an entry's score reads its row), ranked by the one ranking engine (`editing.cuts`)
into the cut the method keeps, and each block's mask of that cut, packed a bit an entry.

A tensor of at most `ranking.HELD` entries has its scores held whole, read once, and every block's
mask made at once; a larger one is ranked by passes over its blocks (holding a block of scores,
not all of them), the first of which counts its non-zero scores, samples them and keeps what the
scores declare of each row (`Scores.per_row`), so that the select may need one pass more, not
two, and its later passes, like the merge's, score a block at less cost."""

from typing import Callable

import numpy as np

from editing import cuts
from merging import sparsity
from merging.checkpoints import pipeline
from merging.checkpoints import ranking


def row_blocks(size: int, row: int | None) -> list[tuple[int, int]]:
  """`pipeline.blocks` of a tensor, each the most whole rows of `row` a block holds (where
  given)."""
  return pipeline.blocks(size, pipeline.BLOCK - pipeline.BLOCK % row if row else None)


def unpacked(mask: np.ndarray) -> np.ndarray:
  """A block's mask packed a bit an entry (np.packbits), as a block's width of booleans."""
  return np.unpackbits(mask, count=pipeline.BLOCK).view(bool)


class TensorScores:
  """The scores of a tensor of `size` entries (in blocks of whole rows of `row`, where given),
  each block's from its inputs, which `read(start, stop)` reads (θ0's buffer, then each
  model's, as `pipeline.read_block` gives them)."""

  def __init__(self, scores: sparsity.Scores, read: Callable[[int, int], list], size: int,
               row: int | None):
    self.scores, self.read, self.size, self.row = scores, read, size, row
    self.spans = row_blocks(size, row)
    self.per_row = {}  # `Scores.per_row` of each block scored, by its first entry

  def of(self, start: int, stop: int, buffers: list) -> np.ndarray:
    """The scores of entries [start, stop), from their read buffers."""
    theta0 = buffers[0][:stop - start].astype(np.float32, copy=False)
    deltas = [pipeline.host_delta(theta[:stop - start], theta0) for theta in buffers[1:]]
    if self.scores.per_row is None:
      return self.scores.score(theta0, deltas, self.row)
    if start not in self.per_row:
      self.per_row[start] = self.scores.per_row(theta0, deltas, self.row)
    return self.scores.score(theta0, deltas, self.row, self.per_row[start])

  def mask(self, start: int, stop: int, buffers: list, selection: cuts.Cut) -> np.ndarray:
    """What `selection` keeps of entries [start, stop), from their read buffers, padded with
    False to a block's width."""
    return _block_mask(self.of(start, stop, buffers), selection, start)

  def selection(self) -> tuple[cuts.Cut, dict | None]:
    """The cut of the tensor's scores that the method keeps, and, where they were held whole,
    every block's mask of it (packed, by the block's first entry); else None, and each pass
    over the blocks scores them again."""
    spans, scores, size = self.spans, self.scores, self.size

    def chunk(i: int) -> np.ndarray:
      return self.of(*spans[i], self.read(*spans[i]))

    if size <= ranking.HELD:
      held = np.concatenate([chunk(i) for i in range(len(spans))])
      passes, sample, nonzero = (lambda: [held]), None, np.count_nonzero(held)
    else:
      held, passes, samples, nonzero = None, lambda: map(chunk, range(len(spans))), [], 0
      stride = cuts.sample_stride(size)
      for i, (start, _) in enumerate(spans):
        values = chunk(i)
        nonzero += np.count_nonzero(values)
        samples.append(values[-start % stride::stride].copy())
      sample = np.concatenate(samples)
    if scores.threshold is not None:  # every score at or above a bound of some of their values
      found = cuts.Cut(scores.threshold(cuts.largest_values(passes, np.float32, size,
                                                            scores.ranks(size), sample)),
                       size - 1)
    else:
      kept = scores.kept(nonzero)
      found = cuts.fixed_cut(size, kept)
      if found is None:
        found, = (cuts.largest_cuts(held, [kept]) if held is not None else
                  cuts.chunked_cuts(chunk, [start for start, _ in spans], np.float32, size,
                                    [kept], sample))
    if held is None:
      return found, None
    return found, {start: np.packbits(_block_mask(held[start:stop], found, start))
                   for start, stop in spans}


def _block_mask(values: np.ndarray, selection: cuts.Cut, start: int) -> np.ndarray:
  """What the tensor's `selection` (its cut of the scores) keeps of the block of scores
  `values` from entry `start` on, padded with False to a block's width."""
  mask = np.zeros(pipeline.BLOCK, bool)
  mask[:values.size] = cuts.cut_mask(values, cuts.Cut(selection.threshold,
                                                      selection.last - start))
  return mask
