"""Safetensors in and out, every file through here: one reader, one streaming writer, and the
Hugging Face directory layout (shards, index) on top of them.

A file is opened once: a pickle (PyTorch's .bin/.pt/.pth and friends) is refused unread, and
the header is parsed and checked against the file's size, so that a truncated or corrupt file
is named with the reason before any tensor is read. Tensors are then read by positioned reads,
a whole tensor or a range of its entries, never through a memory map: the pages of what was
read do not stay in the process's resident memory, and a block read into a reused buffer stays
in the processor's cache.

A file is written tensor by tensor as its entries are made (`write`), to a temporary name that
is renamed into place (`editing.atomic`). A Hugging Face directory is one file or shards of at
most `shard_bytes` with their index (`plan_shards`, `write_index`).
"""

import dataclasses
import hashlib
import json
import math
import os
from typing import Callable, Iterable, Mapping, Sequence

import ml_dtypes
import numpy as np

from editing import atomic
from editing.errors import UserError

# safetensors' dtype codes.
DTYPES = {'F64': np.dtype(np.float64), 'F32': np.dtype(np.float32),
          'F16': np.dtype(np.float16), 'BF16': np.dtype(ml_dtypes.bfloat16),
          'I64': np.dtype(np.int64), 'I32': np.dtype(np.int32), 'I16': np.dtype(np.int16),
          'I8': np.dtype(np.int8), 'U8': np.dtype(np.uint8), 'BOOL': np.dtype(np.bool_)}
_CODES = {dtype: code for code, dtype in DTYPES.items()}
# The first bytes of a pickle (protocol 2 and later) and of PyTorch's zip-of-pickles format.
_PICKLE_MAGIC = (b'\x80', b'PK\x03\x04')
_MAX_HEADER = 100 * 1024**2  # the safetensors format's own bound
SINGLE = 'model.safetensors'
INDEX = 'model.safetensors.index.json'
Entry = tuple[str, tuple[int, ...], np.dtype]  # a tensor's name, shape and dtype


def refuse_pickle(path: str) -> None:
  """A UserError, without unpickling, when `path` is a pickle rather than safetensors."""
  with open(path, 'rb') as f:
    head = f.read(9)
  # safetensors: an 8-byte header length, then the JSON header. Its first byte can be 0x80
  # (a length of 128), so the JSON brace decides before the pickle magic does.
  if head[8:9] == b'{':
    return
  if head.startswith(_PICKLE_MAGIC):
    raise UserError(f'{path} is a pickle (a PyTorch .bin/.pt/.pth checkpoint?), which is never '
                    'unpickled here; convert it to safetensors first, e.g. in PyTorch: '
                    'safetensors.torch.save_file(torch.load(path), "model.safetensors")')


class File:
  """One safetensors file, its header parsed and checked once."""

  def __init__(self, path: str):
    if not os.path.exists(path):
      raise FileNotFoundError(f'no safetensors file at {path}')
    refuse_pickle(path)
    self.path = path
    size = os.path.getsize(path)
    with open(path, 'rb') as f:
      length = int.from_bytes(f.read(8), 'little')
      if size < 8 or not 2 <= length <= min(_MAX_HEADER, size - 8):
        self._corrupt(f'a header of {length} bytes in a file of {size}')
      try:
        header = json.loads(f.read(length))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        self._corrupt(f'its header is not JSON: {e}')
    if not isinstance(header, dict):
      self._corrupt('its header is not a JSON object')
    self.metadata = header.pop('__metadata__', None) or {}
    self.data_start = 8 + length
    self.entries: dict[str, dict] = header
    for name, entry in header.items():
      self._check_entry(name, entry, size - self.data_start)

  def _corrupt(self, reason: str):
    raise UserError(f'{self.path} is not a readable safetensors file ({reason}); it may be '
                    'truncated or corrupt: regenerate it')

  def _check_entry(self, name: str, entry, data_bytes: int) -> None:
    try:
      begin, end = entry['data_offsets']
      count = math.prod(entry['shape'])
      itemsize = DTYPES[entry['dtype']].itemsize if entry['dtype'] in DTYPES else None
    except (KeyError, TypeError, ValueError):
      self._corrupt(f'the entry of {name} is malformed')
    if not 0 <= begin <= end:
      self._corrupt(f'{name} has data offsets {[begin, end]}')
    if end > data_bytes:
      self._corrupt(f'{name} ends {end - data_bytes} bytes past the end of the file')
    if itemsize is not None and end - begin != count * itemsize:
      self._corrupt(f'{name} holds {end - begin} bytes for {count} entries of {entry["dtype"]}')

  @property
  def names(self) -> list[str]:
    return list(self.entries)

  def header(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """A tensor's shape and numpy dtype; KeyError if there is none."""
    entry = self.entries[name]
    dtype = DTYPES.get(entry['dtype'])
    if dtype is None:
      raise UserError(f'{self.path}: {name} has dtype {entry["dtype"]}, which is not read here')
    return tuple(entry['shape']), dtype

  def read(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    """Entries [start, stop) of a tensor in row-major order, as stored, into `out` (a 1-D
    array of the tensor's dtype and at least stop − start entries; a new one if None)."""
    shape, dtype = self.header(name)
    if not 0 <= start <= stop <= math.prod(shape):
      raise ValueError(f'{name}: entries [{start}, {stop}) of a tensor of {math.prod(shape)}')
    count = stop - start
    if out is None:
      out = np.empty(count, dtype)
    elif out.dtype != dtype or out.size < count:
      raise ValueError(f'{name}: read into {out.dtype}[{out.size}], not {dtype}[{count}]')
    view = out[:count].view(np.uint8)
    begin = self.data_start + self.entries[name]['data_offsets'][0] + start * dtype.itemsize
    fd = os.open(self.path, os.O_RDONLY)
    try:
      done = 0
      while done < view.size:  # a single read returns at most about 2 GB on Linux
        got = os.preadv(fd, [view[done:]], begin + done)
        if got == 0:
          raise UserError(f'{self.path}: {name} ends past the end of the file; it is truncated')
        done += got
    finally:
      os.close(fd)
    return out[:count]

  def tensor(self, name: str) -> np.ndarray:
    """One tensor as stored (float32, bfloat16, float16, ...)."""
    shape, _ = self.header(name)
    return self.read(name, 0, math.prod(shape)).reshape(shape)


def load(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """({name: tensor}, the file's metadata) of a whole file."""
  file = File(path)
  return {name: file.tensor(name) for name in file.names}, file.metadata


def write(path: str, entries: Sequence[Entry], produce: Callable[[str], Iterable[np.ndarray]],
          metadata: Mapping[str, str] | None = None) -> None:
  """A safetensors file whose tensors are made by produce(name), in `entries`' order, each
  written as it comes, so the file is never whole in memory: produce yields a tensor's entries
  in row-major order as consecutive chunks. Written to a temporary name and renamed."""
  header, offset = {}, 0
  for name, shape, dtype in entries:
    size = math.prod(shape) * np.dtype(dtype).itemsize
    header[name] = {'dtype': _CODES[np.dtype(dtype)], 'shape': list(shape),
                    'data_offsets': [offset, offset + size]}
    offset += size
  if metadata:
    header['__metadata__'] = dict(metadata)
  blob = json.dumps(header, separators=(',', ':')).encode()
  blob += b' ' * (-len(blob) % 8)
  with atomic.file(path) as f:
    f.write(len(blob).to_bytes(8, 'little') + blob)
    for name, shape, dtype in entries:
      written = 0
      for chunk in produce(name):
        chunk = np.ascontiguousarray(chunk)
        if chunk.dtype != np.dtype(dtype):
          raise ValueError(f'{name}: made {chunk.dtype}, planned {dtype}')
        f.write(chunk.reshape(-1).view(np.uint8).data)
        written += chunk.size
      if written != math.prod(shape):
        raise ValueError(f'{name}: made {written} entries, planned {math.prod(shape)} ({shape})')


def save(path: str, tensors: Mapping[str, np.ndarray],
         metadata: Mapping[str, str] | None = None) -> None:
  """Tensors held in memory as one file, in the order given."""
  arrays = {name: np.asarray(x) for name, x in tensors.items()}
  write(path, [(name, x.shape, x.dtype) for name, x in arrays.items()],
        lambda name: [arrays[name]], metadata)


def fingerprint(path: str) -> dict:
  """What identifies a file's content without reading its data: its size, its modification
  time and the hash of its header (names, dtypes, shapes, offsets)."""
  stat = os.stat(path)
  with open(path, 'rb') as f:
    length = int.from_bytes(f.read(8), 'little')
    header = f.read(min(length, stat.st_size))
  return {'bytes': stat.st_size, 'mtime_ns': stat.st_mtime_ns,
          'header_sha256': hashlib.sha256(header).hexdigest()}


@dataclasses.dataclass(frozen=True)
class Shard:
  """One file of a Hugging Face directory: its name, its tensors and their bytes."""

  file: str
  entries: tuple[Entry, ...]
  bytes: int

  @property
  def names(self) -> list[str]:
    return [name for name, _, _ in self.entries]


def plan_shards(entries: Sequence[Entry], shard_bytes: int) -> list[Shard]:
  """Consecutive entries grouped into shards of at most `shard_bytes` (a larger tensor gets a
  shard of its own), named as Hugging Face names them."""
  groups: list[list[Entry]] = []
  size = 0
  for entry in entries:
    nbytes = math.prod(entry[1]) * np.dtype(entry[2]).itemsize
    if not groups or (size + nbytes > shard_bytes and groups[-1]):
      groups.append([])
      size = 0
    groups[-1].append(entry)
    size += nbytes
  return [Shard(SINGLE if len(groups) == 1 else
                f'model-{i + 1:05d}-of-{len(groups):05d}.safetensors', tuple(group),
                sum(math.prod(s) * np.dtype(d).itemsize for _, s, d in group))
          for i, group in enumerate(groups)]


def write_index(directory: str, shards: Sequence[Shard]) -> None:
  """The index that maps each tensor to its shard, when there are several."""
  if len(shards) > 1:
    atomic.write_json(os.path.join(directory, INDEX), {
        'metadata': {'total_size': sum(s.bytes for s in shards)},
        'weight_map': {n: s.file for s in shards for n in s.names}})
