"""Checkpoint I/O: atomic safetensors files for params and task vectors, orbax for train state.

Finished artefacts (pretrained params, task vectors) are single safetensors files keyed by the
leaves' '/'-joined paths, with JSON metadata, written to a temporary name and renamed so that a
crash never leaves a partial file. Training state goes through an orbax CheckpointManager.
"""

import json
import os
import tempfile
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import safetensors
from safetensors import numpy as safetensors_np

from editing import tree as tree_lib
from editing.task_vector import TaskVector

_META_KEY = 'editmerge'


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to a temporary file beside `path`, then renames it into place."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix='.tmp-', suffix=os.path.basename(path))
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    # mkstemp makes the file private (0600); give it the permissions `open` would have.
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def atomic_write_json(path: str, obj: Any) -> None:
  atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + '\n').encode())


def save_tree(path: str, tree: Any, metadata: dict | None = None) -> None:
  """Saves a dict pytree of arrays as one safetensors file, atomically."""
  flat = {k: np.ascontiguousarray(np.asarray(v)) for k, v in tree_lib.flatten(tree).items()}
  header = {_META_KEY: json.dumps(metadata or {}, sort_keys=True)}
  atomic_write_bytes(path, safetensors_np.save(flat, metadata=header))


def load_tree(path: str) -> tuple[dict, dict]:
  """(nested dict of numpy arrays, metadata) from a file written by `save_tree`."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'no checkpoint file at {path}')
  with safetensors.safe_open(path, framework='numpy') as f:
    flat = {key: f.get_tensor(key) for key in f.keys()}
    metadata = json.loads((f.metadata() or {}).get(_META_KEY, '{}'))
  return tree_lib.unflatten(flat), metadata


def save_task_vector(path: str, vector: TaskVector, extra: dict | None = None) -> None:
  meta = {'tasks': list(vector.tasks), 'regime': vector.regime, 'base': vector.base,
          **(extra or {})}
  save_tree(path, vector.delta, meta)


def load_task_vector(path: str) -> tuple[TaskVector, dict]:
  """(the task vector, the file's whole metadata)."""
  delta, meta = load_tree(path)
  missing = {'tasks', 'regime', 'base'} - meta.keys()
  if missing:
    raise ValueError(f'{path} is not a task vector file: metadata lacks {sorted(missing)}')
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
