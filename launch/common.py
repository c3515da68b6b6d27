"""What the launch jobs share: the workdir layout, config checks, the model, the suite's tasks.

One experiment lives in one workdir:

  <workdir>/pretrain/                      training state, metrics, params.safetensors
  <workdir>/pretrain/heads/<task>.safetensors   frozen heads fitted on θ0
  <workdir>/finetune/<regime>/<task>/      training state, metrics, task_vector.safetensors
                                           (and update_mask.safetensors for a sparse regime)
  <workdir>/evaluation/<regime>/           results.json, report.md, alpha_curves.png,
                                           disentanglement.png
  <workdir>/results.json, report.md        every evaluated regime, and their comparison
  <workdir>/merge/<regime>/<method>/       a merging method's result.json and merged params
"""

import json
import logging as std_logging
import os
from typing import Any, Callable

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from editing import checkpoint
from editing import evaluate
from editing import regimes
from editing import sharding
from editing.data import suite
from editing.data import triggers
from editing.models import head as head_lib
from editing.models import vit

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              'configs', 'quickstart.py')
DEFAULT_WORKDIR = os.path.join('workdir', 'quickstart')

# Every job reads the experiment's config and workdir; defined once here for all of them.
CONFIG = config_flags.DEFINE_config_file(
    'config', DEFAULT_CONFIG, 'experiment config: path[:arg], e.g. configs/quickstart.py:tiny',
    lock_config=True)
WORKDIR = flags.DEFINE_string('workdir', DEFAULT_WORKDIR, 'experiment directory')


def app_main(run: Callable[[ml_collections.ConfigDict, str], Any]) -> Callable[[list[str]], None]:
  """The absl main of a job: `run(config, workdir)` from the shared flags.

  Orbax's per-save INFO lines are kept off the console; its warnings and errors still show.
  """

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    logging.get_absl_handler().addFilter(
        lambda record: record.levelno >= std_logging.WARNING or 'orbax' not in record.pathname)
    run(CONFIG.value, WORKDIR.value)

  return main


def pretrain_dir(workdir: str) -> str:
  return os.path.join(workdir, 'pretrain')


def pretrained_file(workdir: str) -> str:
  return os.path.join(pretrain_dir(workdir), 'params.safetensors')


def head_file(workdir: str, task: str) -> str:
  return os.path.join(pretrain_dir(workdir), 'heads', f'{task}.safetensors')


def finetune_dir(workdir: str, regime: str, task: str) -> str:
  return os.path.join(workdir, 'finetune', regime, task)


# The files a fine-tuning directory ends with.
TASK_VECTOR = 'task_vector.safetensors'
UPDATE_MASK = 'update_mask.safetensors'


def task_vector_file(workdir: str, regime: str, task: str) -> str:
  return os.path.join(finetune_dir(workdir, regime, task), TASK_VECTOR)


def update_mask_file(workdir: str, regime: str, task: str) -> str:
  return os.path.join(finetune_dir(workdir, regime, task), UPDATE_MASK)


def evaluation_dir(workdir: str, regime: str) -> str:
  return os.path.join(workdir, 'evaluation', regime)


def merge_dir(workdir: str, regime: str) -> str:
  return os.path.join(workdir, 'merge', regime)


def names_from(value: str, *, key: str, kind: str, known) -> list[str]:
  """The comma-separated names of the config value at `key`, each one of `known`."""
  names = [n.strip() for n in value.split(',') if n.strip()]
  unknown = [n for n in names if n not in known]
  if unknown or not names:
    raise ValueError(f'{key}: unknown {kind}(s) {unknown or names}; choose from '
                     f'{",".join(known)}')
  return names


def tasks(config: ml_collections.ConfigDict) -> list[str]:
  """The downstream tasks named by `config.suite.tasks`, validated."""
  return names_from(config.suite.tasks, key='config.suite.tasks', kind='task',
                    known=suite.DOWNSTREAM_TASKS)


def configured_regimes(config: ml_collections.ConfigDict) -> list[regimes.Regime]:
  """The regimes named by `config.regimes`, each with its settings section (e.g. config.talos)."""
  return [regime(config, r) for r in names_from(config.regimes, key='config.regimes',
                                                kind='regime', known=regimes.REGISTRY)]


def regime(config: ml_collections.ConfigDict, name: str) -> regimes.Regime:
  """The regime `name` with the settings of its config section, if it has one."""
  section = config.get(name)
  return regimes.get(name, section.to_dict() if section is not None else None)


def poisoned_tasks(config: ml_collections.ConfigDict) -> list[str]:
  """The tasks `config.poison.tasks` names (none when it is empty)."""
  if not config.poison.tasks.strip():
    return []
  return names_from(config.poison.tasks, key='config.poison.tasks', kind='task',
                    known=suite.DOWNSTREAM_TASKS)


def trigger(config: ml_collections.ConfigDict, name: str) -> triggers.Trigger:
  """The trigger `name` with the settings of its config section (e.g. config.badnets)."""
  section = config.get(name)
  return triggers.get(name, section.to_dict() if section is not None else None)


def load_task(config: ml_collections.ConfigDict, name: str) -> suite.Task:
  size = config.suite.pretrain_size if name == suite.CONTROL_TASK else config.suite.train_size
  return suite.load_task(name, seed=config.suite.seed, train_size=size,
                         test_size=config.suite.test_size, val_fraction=config.suite.val_fraction)


def mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  return sharding.make_mesh(config.num_devices or None)


def suite_settings(config: ml_collections.ConfigDict, *names: str) -> dict:
  """The named `config.suite` fields, for recording what a job's data depended on."""
  return {name: config.suite[name] for name in ('seed', 'val_fraction', 'test_size') + names}


def use_compilation_cache(workdir: str) -> None:
  """Keeps compiled programs in <workdir>/.jax_cache.

  Each fine-tune builds its own jitted step; tasks with the same number of classes compile to
  the same program, so only the first of them pays for compilation, and reruns pay for none.
  """
  jax.config.update('jax_compilation_cache_dir', os.path.abspath(os.path.join(workdir,
                                                                              '.jax_cache')))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def check_job_config(directory: str, sections: dict[str, Any]) -> None:
  """Records the config a job directory was made with; a different config is an error.

  Finished or half-finished work is reused only when it was made with the same settings.
  """
  differing = _differing_setting(directory, sections)
  if differing:
    key, then, now = differing
    raise ValueError(f'{directory} was made with other settings ({key}: {then} then, {now} '
                     'now); use another --workdir')


def reusable_result(directory: str, sections: dict[str, Any], result_file: str) -> bool:
  """Whether `result_file` in `directory` was made with these settings and may be reused.

  For cheap, deterministic results (a merge and its evaluation): under other settings the old
  result is deleted and the new settings recorded, so the work is redone rather than refused.
  """
  if _differing_setting(directory, sections):
    if os.path.exists(result_file):
      os.remove(result_file)
    os.remove(os.path.join(directory, 'job_config.json'))
    _differing_setting(directory, sections)
  return os.path.exists(result_file)


def _differing_setting(directory: str, sections: dict[str, Any]) -> tuple | None:
  """(dotted key, recorded value, current value) of the first differing setting, or None.

  Records `sections` in <directory>/job_config.json when nothing is recorded yet.
  """
  path = os.path.join(directory, 'job_config.json')
  current = json.loads(json.dumps(sections, sort_keys=True, default=str))
  if not os.path.exists(path):
    checkpoint.atomic_write_json(path, current)
    return None
  with open(path) as f:
    recorded = _dotted(json.load(f))
  now = _dotted(current)
  differing = sorted(k for k in recorded.keys() | now.keys() if recorded.get(k) != now.get(k))
  if not differing:
    return None
  return differing[0], recorded.get(differing[0]), now.get(differing[0])


def _dotted(tree: dict, prefix: str = '') -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_dotted(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def model(config_model: ml_collections.ConfigDict | dict):
  """(the encoder module, apply_fn(params, images))."""
  module = vit.build(ml_collections.ConfigDict(dict(config_model)))
  return module, lambda params, images: module.apply({'params': params}, images)


def load_pretrained(workdir: str):
  """(θ0, apply_fn) from <workdir>/pretrain/params.safetensors, built from its own metadata."""
  path = pretrained_file(workdir)
  if not os.path.exists(path):
    raise FileNotFoundError(f'no pretrained backbone at {path}; run launch.pretrain (or '
                            'launch.quickstart) with this --workdir first')
  params, meta = checkpoint.load_tree(path)
  _, apply_fn = model(meta['model'])
  return params, apply_fn


def evaluator(config: ml_collections.ConfigDict, apply_fn, regime_name: str) -> evaluate.Evaluator:
  encoder = regimes.get(regime_name).encoder(apply_fn)
  return evaluate.Evaluator(encoder, logit_scale=config.head.logit_scale, mesh=mesh(config),
                            batch_size=config.eval.batch_size)


def head(config: ml_collections.ConfigDict, workdir: str, task: suite.Task, theta0,
         apply_fn) -> jax.Array:
  """The task's frozen prototype head on θ0, fitted once and cached in the workdir."""
  path = head_file(workdir, task.name)
  if not os.path.exists(path):
    features = evaluator(config, apply_fn, 'full').features(theta0, theta0, task.train)
    checkpoint.save_tree(path, {'head': head_lib.fit_prototypes(
        features, task.train.labels, task.num_classes)})
  return checkpoint.load_tree(path)[0]['head']
