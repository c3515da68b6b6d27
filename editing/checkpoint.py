"""Checkpoint I/O: params and task vectors as safetensors files, orbax for train state.

Finished artefacts (pretrained params, task vectors) are single safetensors files keyed by the
leaves' '/'-joined paths, with JSON metadata, written atomically (`editing.safetensors_io`).
Training state goes through an orbax CheckpointManager.

A full disk met while orbax writes, in its own threads or not, is one `UserError` naming the
directory (`disk_full_named`).

Every load checks what it reads: a pickle is refused unread, a truncated or corrupt file is
named with the reason, and a non-finite value is named by its file and leaf path.
"""

import contextlib
import errno
import json
import os
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp

from editing import safetensors_io
from editing import tree as tree_lib
from editing.errors import UserError
from editing.lora import LowRank
from editing.task_vector import TaskVector

_META_KEY = 'editmerge'
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, an exceeded quota


def save_tree(path: str, tree: Any, metadata: dict | None = None) -> None:
  """Saves a dict pytree of arrays as one safetensors file, atomically."""
  # np.require keeps a 0-d leaf 0-d (np.ascontiguousarray would make it 1-d).
  flat = {k: np.require(np.asarray(v), requirements='C')
          for k, v in tree_lib.flatten(tree).items()}
  safetensors_io.save(path, flat, {_META_KEY: json.dumps(metadata or {}, sort_keys=True)})


def load_tree(path: str, *, allow_nonfinite: bool = False) -> tuple[dict, dict]:
  """(nested dict of numpy arrays, metadata) from a file written by `save_tree`.

  Raises FileNotFoundError when there is no file, and UserError naming the file when it is a
  pickle, not readable safetensors, or (unless `allow_nonfinite`) holds a NaN or an infinity.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f'no checkpoint file at {path}')
  flat, metadata = safetensors_io.load(path)
  try:
    metadata = json.loads(metadata.get(_META_KEY, '{}'))
  except json.JSONDecodeError as e:
    raise UserError(f'{path}: its {_META_KEY} metadata is not JSON ({e}); regenerate it') from None
  tree = tree_lib.unflatten(flat)
  if not allow_nonfinite:
    tree_lib.check_finite(tree, path)
  return tree, metadata


def save_task_vector(path: str, vector: TaskVector, extra: dict | None = None) -> None:
  """A LoRA vector is saved as its factors, `<path>/a`, `/b` and `/scale` per adapted kernel,
  with the kernels' shapes in the metadata."""
  meta = {'tasks': list(vector.tasks), 'regime': vector.regime, 'base': vector.base,
          **(extra or {})}
  if vector.low_rank:
    meta['low_rank'] = {p: list(d.shape) for p, d in vector.delta.items()}
  save_tree(path, vector.delta, meta)


def load_task_vector(path: str) -> tuple[TaskVector, dict]:
  """(the task vector, the file's whole metadata)."""
  delta, meta = load_tree(path)
  missing = {'tasks', 'regime', 'base'} - meta.keys()
  if missing:
    raise UserError(f'{path} is not a task vector file: metadata lacks {sorted(missing)}')
  if 'low_rank' in meta:
    flat = tree_lib.flatten(delta)
    try:
      delta = {p: LowRank(flat[f'{p}/b'], flat[f'{p}/a'], flat[f'{p}/scale'], tuple(shape))
               for p, shape in meta['low_rank'].items()}
    except KeyError as e:
      raise UserError(f'{path}: the LoRA factor {e.args[0]} is missing') from None
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


def is_disk_full(error: BaseException) -> bool:
  """Whether `error`, or any error it was raised from or while handling, is a full disk or an
  exceeded quota: orbax's threads hand their errors to the main thread wrapped."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _FULL:
      return True
    # tensorstore, which writes orbax's arrays, raises a ValueError quoting the OS's words.
    if any(os.strerror(code) in str(error) for code in _FULL):
      return True
    error = error.__cause__ or error.__context__
  return False


@contextlib.contextmanager
def disk_full_named(directory: str) -> Iterator[None]:
  """Raises a full disk met inside the block as one UserError naming `directory`.

  What was saved before is kept: orbax writes each step into a temporary directory that it
  renames only once complete, so a rerun resumes from the last complete step.
  """
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    if not is_disk_full(e):
      raise
    raise disk_full_error(directory) from None


def disk_full_error(directory: str) -> UserError:
  """The error of a full disk under `directory`, saying what to do."""
  return UserError(f'{directory}: no space is left on its file system (or the disk quota is '
                   'exceeded); free space and rerun: finished work is kept, and the run resumes '
                   'from its last saved step')
