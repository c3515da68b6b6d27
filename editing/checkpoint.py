"""Checkpoint I/O: atomic safetensors files for params and task vectors, orbax for train state.

Finished artefacts (pretrained params, task vectors) are single safetensors files keyed by the
leaves' '/'-joined paths, with JSON metadata, written to a temporary name and renamed so that a
crash never leaves a partial file. Training state goes through an orbax CheckpointManager.

Every load checks what it reads: a pickle (PyTorch's .bin/.pt/.pth and friends) is refused
unread, a file safetensors cannot parse (truncated, corrupt) is named with the parser's reason,
and a non-finite value is named by its file and leaf path.
"""

import contextlib
import json
import math
import os
import tempfile
from typing import Any, Callable, Iterable

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import safetensors
from safetensors import numpy as safetensors_np

from editing import distributed
from editing import tree as tree_lib
from editing.errors import UserError
from editing.task_vector import TaskVector

_META_KEY = 'editmerge'


@contextlib.contextmanager
def atomic_file(path: str):
  """A binary file to write, at a temporary name beside `path` until the block ends without an
  error, then renamed into place; on an error it is removed and `path` is untouched.

  In a multi-process run only process 0 writes (the others' blocks write to /dev/null), and
  every process waits for it at the end of the block, so all then read the same finished file.
  """
  if not distributed.is_primary():
    with open(os.devnull, 'wb') as f:
      yield f
    distributed.sync(f'wrote {path}')
    return
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix='.tmp-', suffix=os.path.basename(path))
  try:
    with os.fdopen(fd, 'wb') as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    # mkstemp makes the file private (0600); give it the permissions `open` would have.
    os.chmod(tmp, 0o666 & ~umask())
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise
  distributed.sync(f'wrote {path}')


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to a temporary file beside `path`, then renames it into place."""
  with atomic_file(path) as f:
    f.write(data)


def umask() -> int:
  """The process's file-creation mask."""
  mask = os.umask(0)
  os.umask(mask)
  return mask


def atomic_write_json(path: str, obj: Any) -> None:
  atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + '\n').encode())


def save_tree(path: str, tree: Any, metadata: dict | None = None) -> None:
  """Saves a dict pytree of arrays as one safetensors file, atomically."""
  # np.require keeps a 0-d leaf 0-d (np.ascontiguousarray would make it 1-d).
  flat = {k: np.require(np.asarray(v), requirements='C')
          for k, v in tree_lib.flatten(tree).items()}
  header = {_META_KEY: json.dumps(metadata or {}, sort_keys=True)}
  atomic_write_bytes(path, safetensors_np.save(flat, metadata=header))


def load_tree(path: str, *, allow_nonfinite: bool = False) -> tuple[dict, dict]:
  """(nested dict of numpy arrays, metadata) from a file written by `save_tree`.

  Raises FileNotFoundError when there is no file, and UserError naming the file when it is a
  pickle, not readable safetensors, or (unless `allow_nonfinite`) holds a NaN or an infinity.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f'no checkpoint file at {path}')
  refuse_pickle(path)
  try:
    with safetensors.safe_open(path, framework='numpy') as f:
      flat = {key: f.get_tensor(key) for key in f.keys()}
      metadata = json.loads((f.metadata() or {}).get(_META_KEY, '{}'))
  except (safetensors.SafetensorError, OSError, json.JSONDecodeError) as e:
    raise UserError(f'{path} is not a readable safetensors file ({e}); it may be truncated or '
                    'corrupt: regenerate it') from None
  tree = tree_lib.unflatten(flat)
  if not allow_nonfinite:
    tree_lib.check_finite(tree, path)
  return tree, metadata


# The first bytes of a pickle (protocol 2 and later) and of PyTorch's zip-of-pickles format.
_PICKLE_MAGIC = (b'\x80', b'PK\x03\x04')


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


# safetensors' dtype codes.
DTYPES = {'F64': np.dtype(np.float64), 'F32': np.dtype(np.float32),
          'F16': np.dtype(np.float16), 'BF16': np.dtype(ml_dtypes.bfloat16),
          'I64': np.dtype(np.int64), 'I32': np.dtype(np.int32), 'I16': np.dtype(np.int16),
          'I8': np.dtype(np.int8), 'U8': np.dtype(np.uint8), 'BOOL': np.dtype(np.bool_)}
_CODES = {dtype: code for code, dtype in DTYPES.items()}


def write_safetensors(path: str, entries: list[tuple[str, tuple[int, ...], np.dtype]],
                      produce: Callable[[str], Iterable[np.ndarray]],
                      metadata: dict | None = None) -> None:
  """A safetensors file whose tensors are made by produce(name), in `entries`' order, each
  written as it comes, so the file is never whole in memory: produce yields a tensor's entries
  in row-major order as consecutive chunks. The header comes from the entries (name, shape,
  dtype). Written to a temporary name and renamed."""
  header, offset = {}, 0
  for name, shape, dtype in entries:
    size = math.prod(shape) * np.dtype(dtype).itemsize
    header[name] = {'dtype': _CODES[np.dtype(dtype)], 'shape': list(shape),
                    'data_offsets': [offset, offset + size]}
    offset += size
  if metadata:
    header['__metadata__'] = metadata
  blob = json.dumps(header, separators=(',', ':')).encode()
  blob += b' ' * (-len(blob) % 8)
  with atomic_file(path) as f:
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


def save_task_vector(path: str, vector: TaskVector, extra: dict | None = None) -> None:
  meta = {'tasks': list(vector.tasks), 'regime': vector.regime, 'base': vector.base,
          **(extra or {})}
  save_tree(path, vector.delta, meta)


def load_task_vector(path: str) -> tuple[TaskVector, dict]:
  """(the task vector, the file's whole metadata)."""
  delta, meta = load_tree(path)
  missing = {'tasks', 'regime', 'base'} - meta.keys()
  if missing:
    raise UserError(f'{path} is not a task vector file: metadata lacks {sorted(missing)}')
  return TaskVector(delta, tuple(meta['tasks']), meta['regime'], meta['base']), meta


def manager(directory: str, *, save_every: int, max_to_keep: int = 2) -> ocp.CheckpointManager:
  """An orbax CheckpointManager saving every `save_every` steps, asynchronously."""
  options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=max_to_keep,
                                         create=True)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def restore_latest(mngr: ocp.CheckpointManager, like: Any) -> Any | None:
  """The latest saved state shaped and sharded like `like`, or None when there is none."""
  step = mngr.latest_step()
  if step is None:
    return None
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
  return mngr.restore(step, args=ocp.args.StandardRestore(abstract))
