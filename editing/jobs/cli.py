"""The absl main every launch job shares: `--config` and `--workdir`, then one library call.

`--multihost` (or the coordinator flags) makes the job one process of a multi-process run
(`editing.distributed`). Flags are defined when a main calls `run`, never on import, so
importing any job module (from a notebook, a test or another job) defines none. Bad input (a
config override that names no key or has the wrong type, a `UserError`, a missing file, a
diverged run) ends the job with one line on stderr and exit status 1; any other exception is a
bug and keeps its traceback.
"""

import logging as std_logging
import os
import sys
import types
from typing import Any, Callable

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from editing import distributed
from editing.errors import UserError

DEFAULT_WORKDIR = os.path.join('workdir', 'quickstart')
Job = Callable[[ml_collections.ConfigDict, str], Any]


def run(job: Job, default_config: types.ModuleType) -> None:
  """Runs job(config, workdir) as the absl main.

  Args:
    job: the library call, job(config, workdir).
    default_config: the configs/ module used when --config is not given.
  """
  config = config_flags.DEFINE_config_file(
      'config', default_config.__file__,
      'experiment config: path[:arg], e.g. configs/quickstart.py:tiny', lock_config=True)
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
    # Orbax's per-save INFO lines are kept off the console; its warnings and errors still show.
    logging.get_absl_handler().addFilter(
        lambda record: record.levelno >= std_logging.WARNING or 'orbax' not in record.pathname)
    try:
      if multihost.value or coordinator.value or num_processes.value is not None:
        distributed.initialize(coordinator.value, num_processes.value, process_id.value)
        if not distributed.is_primary():
          # Every process runs the whole job; one copy of its logs and tables is enough.
          logging.set_verbosity(logging.WARNING)
          sys.stdout = open(os.devnull, 'w')
      job(config.value, workdir.value)
    except (UserError, FileNotFoundError, FloatingPointError) as e:
      sys.exit(f'error: {e}')

  app.run(main, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a config override that fails (an unknown key, a value of the
  wrong type) reported in one line rather than a chain of tracebacks."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f'error: {e}\nPass --helpfull to see the flags.')
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    # ml_collections nests the KeyError's repr in the message: undo its quoting and escapes.
    text = str(e.args[0] if e.args else e).replace("\\'", "'").replace('\\n', ' ')
    if len(text) > 1 and text[0] == text[-1] and text[0] in '\'"':
      text = text[1:-1]
    message = ' '.join(text.split())
    overrides = ' '.join(a for a in argv[1:] if a.startswith('--config.'))
    sys.exit(f'error: a config override ({overrides}) fails: {message}')
