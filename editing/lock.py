"""One writer at a time: a job holds an exclusive lock on the workdir (or output) it writes.

The lock is the kernel's `flock` on a lock file, so it is released when its holder exits in any
way, kill -9 included: a lock file left by a killed job is simply taken over. The file records
its holder (pid, host, start time), which a second job's error names.
"""

import contextlib
import datetime
import fcntl
import os
import socket
from typing import Iterator

from editing.errors import UserError


@contextlib.contextmanager
def held(lock_file: str, what: str) -> Iterator[None]:
  """Holds the lock `lock_file` for the block, or refuses at once, naming `what` is locked and
  by whom. The directory of `lock_file` is made if need be; the lock file and the directory
  this made are removed again if the block left nothing beside them (a job refused for bad
  input leaves no trace)."""
  directory = os.path.dirname(os.path.abspath(lock_file))
  made_directory = not os.path.isdir(directory)
  made_file = not os.path.exists(lock_file)
  os.makedirs(directory, exist_ok=True)
  fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
  locked = False
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 1024, 0).decode(errors='replace').strip() or 'another process'
      raise UserError(f'{what} is in use by {holder}; wait for it to finish, or use another '
                      'path') from None
    locked = True
    started = datetime.datetime.now().astimezone().isoformat(timespec='seconds')
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'pid {os.getpid()} on {socket.gethostname()}, started {started}\n'.encode(), 0)
    yield
  finally:
    if locked and made_file and os.listdir(directory) == [os.path.basename(lock_file)]:
      os.unlink(lock_file)
      if made_directory:
        os.rmdir(directory)
    os.close(fd)  # releases the lock; a lock file left stays for the next holder to reuse


def workdir(directory: str) -> contextlib.AbstractContextManager:
  """The lock of a workdir: <workdir>/.lock."""
  return held(os.path.join(directory, '.lock'), f'workdir {directory}')
