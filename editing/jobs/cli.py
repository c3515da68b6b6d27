"""The absl main every launch job shares: `--config` and `--workdir`, then one library call.

`--multihost` (or the coordinator flags) makes the job one process of a multi-process run
(`editing.distributed`). Flags are defined when a main calls `run`, never on import, so
importing any job module (from a notebook, a test or another job) defines none. The job holds
the lock of its workdir (`editing.lock`) while it runs: a second job on the same workdir
is refused at once.

One error path: bad input (a config override that names no key or has the wrong type, a
`UserError`, a missing file, a path the job cannot write, a full disk, a diverged run) ends the
job with one line on stderr and exit status 1. A SIGTERM ends it with one line and status 143, as
orchestrators expect: in training, once the step is saved (`editing.train.Preempted`), its line
says which and how to resume. Any other exception is a bug and keeps its traceback.
"""

import contextlib
import errno
import logging as std_logging
import os
import re
import signal
import sys
import types
import warnings
from typing import Any, Callable, Sequence

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from editing import checkpoint
from editing import distributed
from editing import lock
from editing import train
from editing.errors import UserError

DEFAULT_WORKDIR = os.path.join('workdir', 'quickstart')
Job = Callable[[ml_collections.ConfigDict, str], Any]
SIGTERM_STATUS = 128 + signal.SIGTERM
# What to do about an OSError on a user's path, by its errno.
_PATH_ADVICE = {
    errno.EACCES: 'check its permissions, or choose another path',
    errno.EPERM: 'check its permissions, or choose another path',
    errno.EROFS: 'its file system is read-only; choose a writable path',
    errno.ENOTDIR: 'a part of it is a file, not a directory; choose another path',
    errno.EISDIR: 'it is a directory; give a file path',
    errno.ENOSPC: 'its file system is full; free space or choose another path',
    errno.EDQUOT: 'the disk quota is exceeded; free space or choose another path',
}


class Terminated(BaseException):
  """A SIGTERM outside training (which saves first and raises `train.Preempted`)."""


def run(job: Job, default_config: types.ModuleType, *, locks_workdir: bool = True) -> None:
  """Runs job(config, workdir) as the absl main.

  Args:
    job: the library call, job(config, workdir).
    default_config: the configs/ module used when --config is not given.
    locks_workdir: whether the job holds the workdir's lock (a job that writes elsewhere
      locks what it writes itself).
  """
  try:
    # The default config file is loaded, and the overrides applied to it, right here.
    config = config_flags.DEFINE_config_file(
        'config', default_config.__file__,
        'experiment config: path[:arg], e.g. configs/quickstart.py:tiny', lock_config=True)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    sys.exit(_override_error(e, sys.argv))
  workdir = flags.DEFINE_string('workdir', DEFAULT_WORKDIR, 'experiment directory')
  multihost = flags.DEFINE_bool(
      'multihost', False, 'join the processes of a multi-process run (run the same command on '
      'every host); on a TPU pod slice, SLURM or Open MPI the next three flags are found')
  coordinator = flags.DEFINE_string('coordinator_address', None,
                                    'multi-process: host:port of process 0, the same everywhere')
  num_processes = flags.DEFINE_integer('num_processes', None, 'multi-process: how many')
  process_id = flags.DEFINE_integer('process_id', None, 'multi-process: this one, 0 first')

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    logging.get_absl_handler().addFilter(_shown)
    sys.unraisablehook = _unraisable
    signal.signal(signal.SIGTERM, _terminate)
    try:
      if multihost.value or coordinator.value or num_processes.value is not None:
        distributed.initialize(coordinator.value, num_processes.value, process_id.value)
        if not distributed.is_primary():
          # Every process runs the whole job; one copy of its logs and tables is enough.
          logging.set_verbosity(logging.WARNING)
          sys.stdout = open(os.devnull, 'w')
      # One process of a run holds the lock for all of them.
      held = (lock.workdir(workdir.value) if locks_workdir and distributed.is_primary()
              else contextlib.nullcontext())
      with held:
        job(config.value, workdir.value)
    except train.Preempted as e:
      print(f'error: {e}', file=sys.stderr)
      sys.exit(SIGTERM_STATUS)
    except Terminated:
      print('error: stopped by SIGTERM; finished work is kept, and the same command goes on '
            'from it', file=sys.stderr)
      sys.exit(SIGTERM_STATUS)
    except Exception as e:  # pylint: disable=broad-except
      line = _error_line(e, workdir.value)
      if line is None:
        raise
      # A failed save abandons orbax's writers, whose coroutines are collected at exit.
      warnings.filterwarnings('ignore', r"coroutine '.*' was never awaited", RuntimeWarning)
      sys.exit(line)

  app.run(main, flags_parser=_parse_flags)


def _error_line(e: Exception, workdir: str) -> str | None:
  """The one line that ends a job on `e`, or None for a bug (which keeps its traceback).

  An OSError on a path names the path; a full disk met where no path is known (wrapped by
  orbax's or tensorstore's threads) names the workdir.
  """
  if isinstance(e, (UserError, FileNotFoundError, FloatingPointError)):
    return f'error: {e}'
  if isinstance(e, OSError) and e.filename and e.errno in _PATH_ADVICE:
    return f'error: {e.filename}: {e.strerror}; {_PATH_ADVICE[e.errno]}'
  if checkpoint.is_disk_full(e):
    return f'error: {checkpoint.disk_full_error(workdir)}'
  if isinstance(e, OSError) and e.errno in _PATH_ADVICE:
    return f'error: a path: {e.strerror}; {_PATH_ADVICE[e.errno]}'
  return None


def _shown(record: std_logging.LogRecord) -> bool:
  """Whether a log record reaches the console. Orbax's per-save INFO lines do not, nor the
  tracebacks of a failure in its threads (logged there, and by asyncio of its abandoned
  tasks): the main thread gets the same error and the job reports it once. Its other warnings
  and errors do."""
  about_orbax = 'orbax' in record.pathname or (record.name == 'asyncio' and
                                               'orbax' in record.getMessage())
  if not about_orbax:
    return True
  return record.levelno >= std_logging.WARNING and not record.exc_info


def _unraisable(unraisable) -> None:
  """Drops what a failed save leaves behind once the job has reported it: the 'Event loop is
  closed' errors of tensorstore's callbacks after orbax closed that save's event loop, and a
  full disk met again by writers closing at exit. Shows the others."""
  error = unraisable.exc_value
  if not ((isinstance(error, RuntimeError) and str(error) == 'Event loop is closed') or
          checkpoint.is_disk_full(error)):
    sys.__unraisablehook__(unraisable)


def _terminate(signum, frame) -> None:
  del signum, frame
  raise Terminated()


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a config override that fails (an unknown key, a value of the
  wrong type) reported in one line rather than a chain of tracebacks."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f'error: {e}\nPass --helpfull to see the flags.')
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    sys.exit(_override_error(e, argv))


def _override_error(e: Exception, argv: Sequence[str]) -> str:
  """The line for a config override that fails, naming that override (every override when
  the message names none of their keys)."""
  # ml_collections nests the KeyError's repr in the message: undo its quoting and escapes.
  text = str(e.args[0] if e.args else e).replace("\\'", "'").replace('\\n', ' ')
  if len(text) > 1 and text[0] == text[-1] and text[0] in '\'"':
    text = text[1:-1]
  message = ' '.join(text.split())
  overrides = [a for a in argv[1:] if a.startswith('--config.')]
  named = set(re.findall(r"'([\w.]+)'", message) or re.findall(r'[\w.]+', message))
  failing = [a for a in overrides
             if set(a.split('=', 1)[0][len('--config.'):].split('.')) & named] or overrides
  return f'error: a config override ({" ".join(failing)}) fails: {message}'


