"""What a job read of its inputs, hashed as it reads it, so that a resumed job can tell whether
the data its finished shards were made from is still the data on disk.

A tensor of n entries is cut into chunks of `CHUNK` entries; a read of entries [a, b) takes the
CRC-32 of every chunk it covers whole, and the tensor's digest is the SHA-256 of its chunks'
CRCs in order, known once every chunk was read. The digest depends on the tensor's bytes
alone, not on how the job happened to read them (whole, or a block at a time in threads, in
any order): the block pipeline reads aligned blocks of `pipeline.BLOCK` entries, the same
chunks.

Why hash the reads rather than each input file once at the start: hashing a file first is a
whole extra read of every input, twice the I/O of a merge whose inputs do not fit the page
cache, while hashing what the merge reads anyway costs only the hash, in the threads that
read. Why a CRC: it guards against an edit, not an adversary, and runs about three times as
fast as SHA-256 (zlib's CRC-32 at 1.4 GB/s a core on a loaded machine where SHA-256 ran at
0.45), so that the merge stays near the speed of its reads; a CRC-32 catches every change of
up to 32 consecutive bits in a chunk, and misses any other with odds of 2⁻³². The check costs
a resume alone: the tensors the record names are read once more, never more than a fresh run
reads.
"""

import hashlib
import math
import threading
import zlib
from typing import Sequence

import numpy as np

from editing.errors import UserError
from merging.checkpoints import pipeline

CHUNK = pipeline.BLOCK  # entries


class Watched:
  """A checkpoint (an `hf.Reader`: a checkpoint, a sliced view, an adapted base), read as it
  is, that keeps the CRC of every chunk read."""

  def __init__(self, ckpt):
    self._ckpt, self._crcs, self._lock = ckpt, {}, threading.Lock()

  def __getattr__(self, attribute: str):
    return getattr(self._ckpt, attribute)  # path, config, files, header

  def read(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    entries = self._ckpt.read(name, start, stop, out)
    self._hash(name, start, entries[:stop - start])
    return entries

  def tensor(self, name: str) -> np.ndarray:
    whole = self._ckpt.tensor(name)
    self._hash(name, 0, whole.reshape(-1))
    return whole

  def _hash(self, name: str, start: int, entries: np.ndarray) -> None:
    """Keeps the CRC of each chunk that `entries`, the tensor's from entry `start` on, cover
    whole."""
    size = math.prod(self._ckpt.header(name)[0])
    stop = start + entries.size
    for k in range(-(-start // CHUNK), math.ceil(stop / CHUNK)):
      end = min((k + 1) * CHUNK, size)
      if end <= stop:
        chunk = np.ascontiguousarray(entries[k * CHUNK - start:end - start]).view(np.uint8)
        crc = zlib.crc32(chunk)
        with self._lock:
          self._crcs.setdefault(name, {})[k] = crc

  def digest(self, name: str) -> str | None:
    """The digest of the tensor `name`; None until it was read whole."""
    count = math.ceil(math.prod(self._ckpt.header(name)[0]) / CHUNK)
    with self._lock:
      found = dict(self._crcs.get(name, {}))
    if len(found) < count:
      return None
    return hashlib.sha256(b''.join(found[k].to_bytes(4, 'little')
                                   for k in range(count))).hexdigest()

  def complete(self) -> dict[str, str]:
    """{tensor: digest} of the tensors read whole so far."""
    with self._lock:
      names = list(self._crcs)
    digests = {name: self.digest(name) for name in names}
    return {name: digest for name, digest in digests.items() if digest is not None}

  def check(self, recorded: dict[str, str], where: str) -> None:
    """Reads again each tensor of `recorded` ({tensor: digest}) and refuses, naming its file,
    the first whose data differs: the shards in `where` were made from other data."""
    for name, digest in sorted(recorded.items()):
      size = math.prod(self._ckpt.header(name)[0])
      for start, stop in pipeline.blocks(size):
        self.read(name, start, stop)
      if self.digest(name) != digest:
        raise UserError(f'{self._ckpt.files.get(name, self._ckpt.path)}: {name} has changed '
                        f'since {where} was begun (its data differs from what the finished '
                        'shards were made from); remove it to start over')


def watch(ckpts: Sequence) -> list[Watched]:
  """Each checkpoint with its reads hashed."""
  return [Watched(ckpt) for ckpt in ckpts]
