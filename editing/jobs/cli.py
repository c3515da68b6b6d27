"""The absl main every launch job shares: `--config` and `--workdir`, then one library call.

Flags are defined when a main calls `run`, never on import, so importing any job module (from a
notebook, a test or another job) defines none.
"""

import logging as std_logging
import os
import types
from typing import Any, Callable

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

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

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    # Orbax's per-save INFO lines are kept off the console; its warnings and errors still show.
    logging.get_absl_handler().addFilter(
        lambda record: record.levelno >= std_logging.WARNING or 'orbax' not in record.pathname)
    job(config.value, workdir.value)

  app.run(main)
