"""Progress of a long loop on the console: done/total, rate and time left, every few seconds.

  progress = Progress('task addition', total=len(alphas), unit='edits')
  for alpha in alphas:
    ...
    progress.advance()

A line is logged when `every` seconds have passed since the last one and at the end, so a
short loop logs once and a long one keeps the researcher informed without flooding the log.
"""

import time

from absl import logging


class Progress:
  """Counts finished units of a loop of known length and logs the rate and ETA."""

  def __init__(self, label: str, total: int, *, unit: str = 'steps', every: float = 10.0):
    self._label, self._total, self._unit, self._every = label, total, unit, every
    self._done = 0
    self._start = self._last = time.monotonic()

  def advance(self, count: int = 1) -> None:
    self._done += count
    now = time.monotonic()
    if now - self._last < self._every and self._done < self._total:
      return
    self._last = now
    elapsed = now - self._start
    rate = self._done / max(elapsed, 1e-9)
    left = (self._total - self._done) / max(rate, 1e-9)
    logging.info('%s: %d/%d %s, %.1f %s/s, %ds elapsed, eta %dm%02ds', self._label, self._done,
                 self._total, self._unit, rate, self._unit, elapsed, left // 60, left % 60)
