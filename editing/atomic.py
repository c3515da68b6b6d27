"""Writes that a crash never leaves half-done: a file (or a whole directory) is made beside its
target and put in its place in one step, so the target is, at every instant, the old one or
the new one.

In a multi-process run only process 0 writes files; the others wait for it, so all then read
the same finished file.
"""

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
from typing import Any

from editing import distributed

# The name of every temporary file or directory made here starts so, hidden beside its target.
TEMP_PREFIX = '.tmp-'


@contextlib.contextmanager
def file(path: str):
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
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX,
                              suffix=os.path.basename(path))
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


def write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to a temporary file beside `path`, then renames it into place."""
  with file(path) as f:
    f.write(data)


def umask() -> int:
  """The process's file-creation mask."""
  mask = os.umask(0)
  os.umask(mask)
  return mask


@contextlib.contextmanager
def directory(target: str):
  """A directory to fill, beside `target` until the block ends without an error, then put in
  its place (`replace_directory`); on an error it is removed and `target` is untouched."""
  parent = os.path.dirname(os.path.abspath(target))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=TEMP_PREFIX + os.path.basename(target))
  try:
    yield tmp
    # mkdtemp makes the directory private (0700); give it the permissions makedirs would have.
    os.chmod(tmp, 0o777 & ~umask())
    replace_directory(tmp, target)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def replace_directory(new: str, target: str) -> None:
  """Puts the finished directory `new` at `target` so that `target` is, at every instant,
  either the old directory or the new one, never missing or half-written; the old one is then
  removed. (An atomic exchange of the two where the kernel has one, renameat2; else the old one
  is renamed aside first.)"""
  if not os.path.lexists(target):
    os.replace(new, target)
    return
  if not _exchange(new, target):
    aside = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(target)), prefix='.old-')
    os.replace(target, os.path.join(aside, 'old'))
    os.replace(new, target)
    new = aside
  shutil.rmtree(new)


def _exchange(a: str, b: str) -> bool:
  """Swaps the paths a and b atomically (Linux's renameat2 RENAME_EXCHANGE); False where the
  kernel or C library has no such call."""
  renameat2 = getattr(ctypes.CDLL(None, use_errno=True), 'renameat2', None)
  if renameat2 is None:
    return False
  at_cwd, exchange = -100, 2
  if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
    return True
  code = ctypes.get_errno()
  if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
    return False
  raise OSError(code, os.strerror(code), b)


def write_json(path: str, obj: Any) -> None:
  write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + '\n').encode())
