"""One experiment lives in one workdir; this is its layout and the record of its settings.

  <workdir>/pretrain/                      training state, metrics, params.safetensors
  <workdir>/pretrain/heads/<task>.safetensors   frozen heads fitted on θ0
  <workdir>/finetune/<regime>/<task>/      training state, metrics, task_vector.safetensors
                                           (and update_mask.safetensors for a sparse regime)
  <workdir>/evaluation/                    job_config.json: the settings evaluated under
  <workdir>/evaluation/<regime>/           results.json, report.md, alpha_curves.png,
                                           disentanglement.png
  <workdir>/results.json, report.md        every evaluated regime, and their comparison
  <workdir>/merge/<regime>/                results.json, report.md, and per method
                                           <method>/result.json and <method>/params (orbax)
  <workdir>/safety/                        the backdoor experiment (merging.jobs.safety)
  <workdir>/recipe_search/<regime>/lr<rate>_steps<n>/<task>/   one point of the recipe search;
                                           results.json every point and the choices
  <workdir>/benchmark.json                 launch.benchmark's measurements
  <workdir>/.jax_cache/                    compiled programs, shared by the jobs

Every job directory records the settings it was made with in job_config.json; finished or
half-finished work is reused only under the same settings.
"""

import json
import os
from typing import Any

import jax

from editing import atomic
from editing.errors import UserError

# The files a fine-tuning directory ends with.
TASK_VECTOR = 'task_vector.safetensors'
UPDATE_MASK = 'update_mask.safetensors'
JOB_CONFIG = 'job_config.json'


def pretrain_dir(workdir: str) -> str:
  return os.path.join(workdir, 'pretrain')


def pretrained_file(workdir: str) -> str:
  return os.path.join(pretrain_dir(workdir), 'params.safetensors')


def head_file(workdir: str, task: str) -> str:
  return os.path.join(pretrain_dir(workdir), 'heads', f'{task}.safetensors')


def finetune_dir(workdir: str, regime: str, task: str) -> str:
  return os.path.join(workdir, 'finetune', regime, task)


def task_vector_file(workdir: str, regime: str, task: str) -> str:
  return os.path.join(finetune_dir(workdir, regime, task), TASK_VECTOR)


def update_mask_file(workdir: str, regime: str, task: str) -> str:
  return os.path.join(finetune_dir(workdir, regime, task), UPDATE_MASK)


def evaluation_root(workdir: str) -> str:
  return os.path.join(workdir, 'evaluation')


def evaluation_dir(workdir: str, regime: str) -> str:
  return os.path.join(evaluation_root(workdir), regime)


def merge_dir(workdir: str, regime: str) -> str:
  return os.path.join(workdir, 'merge', regime)


def safety_dir(workdir: str) -> str:
  return os.path.join(workdir, 'safety')


def behaviour_dir(workdir: str) -> str:
  return os.path.join(workdir, 'behaviour')


def use_compilation_cache(workdir: str) -> None:
  """Keeps compiled programs in <workdir>/.jax_cache, or in $JAX_COMPILATION_CACHE_DIR where
  that is set (one cache for many workdirs: a cluster's, a test session's).

  Each fine-tune builds its own jitted step; with heads padded to a common number of classes
  (`head.padded`) every task of a regime compiles to the same program, so only the first pays
  for compilation, and reruns pay for none.
  """
  if not os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    jax.config.update('jax_compilation_cache_dir', os.path.abspath(os.path.join(workdir,
                                                                                '.jax_cache')))
  if not os.environ.get('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'):
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def check_job_config(directory: str, sections: dict[str, Any]) -> None:
  """Records the config a job directory was made with; a different config is an error.

  Finished or half-finished work is reused only when it was made with the same settings.
  """
  differing = _differing_setting(directory, sections)
  if differing:
    key, then, now = differing
    raise UserError(f'{directory} was made with other settings ({key}: {then} then, {now} '
                     'now); use another --workdir')


def recorded_as(directory: str, sections: dict[str, Any]) -> bool:
  """Whether `directory` records exactly these settings (nothing is written)."""
  path = os.path.join(directory, JOB_CONFIG)
  if not os.path.exists(path):
    return False
  with open(path) as f:
    recorded = json.load(f)
  return recorded == json.loads(json.dumps(sections, sort_keys=True, default=str))


def reusable_result(directory: str, sections: dict[str, Any], result_file: str) -> bool:
  """Whether `result_file` in `directory` was made with these settings and may be reused.

  For cheap, deterministic results (a merge and its evaluation): under other settings the old
  result is deleted and the new settings recorded, so the work is redone rather than refused.
  """
  if _differing_setting(directory, sections):
    if os.path.exists(result_file):
      os.remove(result_file)
    os.remove(os.path.join(directory, JOB_CONFIG))
    _differing_setting(directory, sections)
  return os.path.exists(result_file)


def _differing_setting(directory: str, sections: dict[str, Any]) -> tuple | None:
  """(dotted key, recorded value, current value) of the first differing setting, or None.

  Records `sections` in <directory>/job_config.json when nothing is recorded yet.
  """
  path = os.path.join(directory, JOB_CONFIG)
  current = json.loads(json.dumps(sections, sort_keys=True, default=str))
  if not os.path.exists(path):
    atomic.write_json(path, current)
    return None
  with open(path) as f:
    recorded = dotted(json.load(f))
  now = dotted(current)
  differing = sorted(k for k in recorded.keys() | now.keys() if recorded.get(k) != now.get(k))
  if not differing:
    return None
  return differing[0], recorded.get(differing[0]), now.get(differing[0])


def dotted(tree: dict, prefix: str = '') -> dict[str, Any]:
  """{'a.b.c': leaf} of a nested dict."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(dotted(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat
