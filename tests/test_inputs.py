"""Bad input: each case gives one clear error naming what is wrong, and changes nothing on disk.

The table runs every case on its own copy of a finished tiny workdir; the property tests
generate config values, trees and corrupted files and hold the contract: a clean error naming
the input, or a valid result, never a silent wrong one.
"""

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
from typing import Callable

import hypothesis
import hypothesis.strategies as st
import jax
import ml_collections
import ml_dtypes
import numpy as np
import pytest
from safetensors import numpy as safetensors_np

from configs import merge as merge_config
from editing import checkpoint
from editing import tree as tree_lib
from editing.errors import UserError
from editing.jobs import evaluate
from editing.jobs import checks
from editing.jobs import experiment
from editing.jobs import finetune
from editing.jobs import pretrain
from editing.jobs import quickstart
from editing.jobs import workdir as workdir_lib
from editing.task_vector import TaskVector
from merging.jobs import merge
from tests.conftest import xla_flags


def snapshot(directory: str) -> dict[str, str]:
  """{relative path: sha256} of every file below `directory`, less the workdir's lock file
  (its holder's record, which each job rewrites)."""
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      if path == os.path.join(directory, '.lock'):
        continue
      with open(path, 'rb') as f:
        out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return out


def rewrite_vector(workdir, task, change):
  """Replaces the full regime's task vector of `task` by change(flat delta), metadata kept."""
  path = workdir_lib.task_vector_file(workdir, 'full', task)
  vector, meta = checkpoint.load_task_vector(path)
  flat = {k: np.array(v) for k, v in tree_lib.flatten(vector.delta).items()}
  change(flat)
  header = {'editmerge': json.dumps(meta, sort_keys=True)}
  with open(path, 'wb') as f:
    f.write(safetensors_np.save(flat, metadata=header))


def set_value(value):
  def change(flat):
    flat['blocks_1/mlp_fc/kernel'][0, 3] = value
  return change


def truncate(path):
  with open(path, 'rb') as f:
    data = f.read()
  with open(path, 'wb') as f:
    f.write(data[:len(data) // 2])


def replace_with_pickle(path):
  with open(path, 'wb') as f:
    f.write(pickle.dumps({'state_dict': [1.0, 2.0]}))


def foreign_theta0(workdir):
  """θ0 of the same shapes and model config, other values."""
  path = workdir_lib.pretrained_file(workdir)
  params, meta = checkpoint.load_tree(path)
  checkpoint.save_tree(path, jax.tree.map(lambda x: x + 0.01, params), meta)


def other_model_in_pretrain(workdir):
  """A backbone file recorded with another model config than the one the config asks for."""
  path = workdir_lib.pretrained_file(workdir)
  params, meta = checkpoint.load_tree(path)
  checkpoint.save_tree(path, params, dict(meta, model=dict(meta['model'], width=64)))


def tiny(**overrides) -> ml_collections.ConfigDict:
  """The tiny merge config (a superset of every job's) for the full regime, with overrides
  {'section.key': value} or {'section': a whole section}."""
  config = merge_config.get_config('tiny')
  config.regimes = 'full'
  for key, value in overrides.items():
    if '.' in key:
      section, name = key.split('.')
      config[section][name] = value
    else:
      config[key] = value
  return config


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  call: Callable[[str], object]  # workdir -> the job call expected to fail
  message: str  # a regex the error must match
  corrupt: Callable[[str], None]  # workdir -> None, applied before the snapshot


def vector_file(task):
  return lambda workdir: workdir_lib.task_vector_file(workdir, 'full', task)


CASES = (
    Case('NaN task vector at evaluate',
         lambda w: evaluate.run(tiny(), w),
         r'full/colour/task_vector.safetensors: blocks_1/mlp_fc/kernel holds non-finite',
         corrupt=lambda w: rewrite_vector(w, 'colour', set_value(np.nan))),
    Case('Inf task vector at merge',
         lambda w: merge.run(tiny(), w),
         r'full/size/task_vector.safetensors: blocks_1/mlp_fc/kernel holds non-finite',
         corrupt=lambda w: rewrite_vector(w, 'size', set_value(np.inf))),
    Case('truncated task vector',
         lambda w: evaluate.run(tiny(), w),
         r'digits/task_vector.safetensors is not a readable safetensors file',
         corrupt=lambda w: truncate(vector_file('digits')(w))),
    Case('pickle bytes in a .safetensors file',
         lambda w: merge.run(tiny(), w),
         r'digits/task_vector.safetensors is a pickle.*never unpickled.*convert',
         corrupt=lambda w: replace_with_pickle(vector_file('digits')(w))),
    Case('foreign θ0 at evaluate',
         lambda w: evaluate.run(tiny(), w),
         r'digits/task_vector.safetensors was fine-tuned from the backbone with fingerprint',
         corrupt=foreign_theta0),
    Case('foreign θ0 at merge',
         lambda w: merge.run(tiny(), w),
         r'was fine-tuned from the backbone with fingerprint',
         corrupt=foreign_theta0),
    Case('a backbone file of another model',
         lambda w: pretrain.run(tiny(), w),
         r'params.safetensors holds a backbone of model .*width.: 64',
         corrupt=other_model_in_pretrain),
)


JOBS = {
    'evaluate': evaluate.run,
    'merge': merge.run,
    'finetune': lambda config, workdir: finetune.run(
        config, workdir, 'digits', experiment.regime(tiny(), 'attention_only')),
}

# (the job, the config's overrides, a regex the error must match)
BAD_SETTINGS = (
    ('evaluate', {'suite.seed': 1},
     r'evaluation was made with other settings \(suite.seed: 0 then, 1 now\)'),
    ('finetune', {'finetune.steps': 0},
     r'config.finetune.steps = 0: must be an integer in \[1, inf\)'),
    ('finetune', {'finetune.steps': -5},
     r'config.finetune.steps = -5: must be an integer in \[1, inf\)'),
    ('finetune', {'poison.rate': 1.5, 'poison.tasks': 'digits'},
     r'config.poison.rate = 1.5: must be a number in \[0, 1\]'),
    ('merge', {'ties': ml_collections.ConfigDict({'k': (0.2,)})},
     r'config.ties.k is not a setting; the settings: \[.density.'),
    ('merge', {'ties': ml_collections.ConfigDict({'keep': 'foo'})},
     r'config.ties.keep is not a setting'),
    ('merge', {'ties.density': 0.0}, r'config.ties.density = 0.0: must be a number in \(0, 1\]'),
    ('finetune', {'model.width': 48},
     r'params.safetensors is a backbone with model.width = \d+, but config.model.width = 48'),
    ('evaluate', {'model.width': 48},
     r'params.safetensors is a backbone with model.width = \d+, but config.model.width = 48'),
)


def expect_named_and_nothing_written(source: str, workdir: str, corrupt, call, message: str):
  shutil.copytree(source, workdir)
  corrupt(workdir)
  before = snapshot(workdir)
  with pytest.raises((UserError, FileNotFoundError), match=message):
    call(workdir)
  assert snapshot(workdir) == before


@pytest.mark.parametrize('case', CASES, ids=[c.name for c in CASES])
def test_bad_input_is_named_and_nothing_is_written(case, tiny_run, tmp_path):
  expect_named_and_nothing_written(tiny_run[1], str(tmp_path / 'workdir'), case.corrupt,
                                   case.call, case.message)


@pytest.mark.parametrize('job,overrides,message', BAD_SETTINGS,
                         ids=[f'{job}:{",".join(o)}' for job, o, _ in BAD_SETTINGS])
def test_a_bad_setting_is_named_and_nothing_is_written(job, overrides, message, tiny_run,
                                                       tmp_path):
  expect_named_and_nothing_written(
      tiny_run[1], str(tmp_path / 'workdir'), lambda workdir: None,
      lambda workdir: JOBS[job](tiny(**overrides), workdir), message)


def test_a_batch_the_devices_do_not_divide_spoils_nothing(tiny_run, tmp_path, run_python):
  _, source, _ = tiny_run
  workdir = str(tmp_path / 'workdir')
  shutil.copytree(source, workdir)
  before = snapshot(workdir)
  args = ['-m', 'launch.finetune', '--config=configs/quickstart.py:tiny', f'--workdir={workdir}',
          '--task=digits', '--config.regimes=attention_only']
  env = {'XLA_FLAGS': xla_flags(devices=8)}
  proc = run_python(args + ['--config.finetune.batch_size=30'], env=env, check=False)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      'error: config.finetune.batch_size = 30 is not divisible by the 8 devices of the data '
      'and fsdp axes; use a multiple of 8')
  assert 'Traceback' not in proc.stderr
  assert snapshot(workdir) == before
  # The corrected command then runs in the same workdir.
  vector = finetune.run(tiny(), workdir, 'digits', experiment.regime(tiny(), 'attention_only'))
  assert vector.regime == 'attention_only' and float(vector.norm()) > 0


def test_a_config_typo_is_one_line_on_the_command_line(run_python, tmp_path):
  proc = run_python(['-m', 'launch.evaluate', '--config=configs/quickstart.py:tiny',
                     f'--workdir={tmp_path}', '--config.eval.alpha_stp=0.1'], check=False)
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: a config override (--config.eval.alpha_stp=0.1) fails: 'alpha_stp' Did you mean "
      '"alpha_step" instead of "alpha_stp"?')
  proc = run_python(['-m', 'launch.evaluate', '--config=configs/quickstart.py:tiny',
                     f'--workdir={tmp_path}'], check=False)
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr
  assert 'error: no pretrained backbone at' in proc.stderr.strip().splitlines()[-1]
  assert not os.listdir(tmp_path)


# The documented ranges, restated: (key, the values the config may hold, the valid ones).
RANGES = {
    'finetune.steps': (st.integers(-3, 3), lambda v: v >= 1),
    'finetune.warmup_steps': (st.integers(-3, 3), lambda v: v >= 0),
    'finetune.batch_size': (st.integers(-3, 64), lambda v: v >= 1),
    'finetune.learning_rate': (st.floats(-1, 1, allow_nan=False), lambda v: v > 0),
    'suite.val_fraction': (st.floats(-0.5, 1.5, allow_nan=False), lambda v: 0 < v < 1),
    'poison.rate': (st.floats(-0.5, 1.5, allow_nan=False), lambda v: 0 <= v <= 1),
    'talos.keep': (st.floats(-0.5, 1.5, allow_nan=False), lambda v: 0 < v <= 1),
    'eval.alpha_step': (st.floats(-0.5, 1.5, allow_nan=False), lambda v: 0 < v <= 1),
    'eval.negation_threshold': (st.floats(-0.5, 1.5, allow_nan=False), lambda v: 0 <= v <= 1),
    'merge.train_examples': (st.integers(-3, 3), lambda v: v >= 1),
}


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.data())
def test_config_values_are_valid_or_named(data):
  key = data.draw(st.sampled_from(sorted(RANGES)))
  values, valid = RANGES[key]
  value = data.draw(values)
  config = merge_config.get_config()
  section, name = key.split('.')
  config[section][name] = value
  sections = {**quickstart.SECTIONS, **merge.SECTIONS}
  if valid(value):
    checks.validate(config, sections)
  else:
    with pytest.raises(UserError, match=rf'^config\.{key} = '):
      checks.validate(config, sections)


DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16, np.int32)


@st.composite
def trees(draw):
  """A nested dict of 1-3 leaves of small shapes and mixed dtypes."""
  tree = {}
  for i in range(draw(st.integers(1, 3))):
    shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    values = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) / 3
    tree.setdefault(f'layer_{i % 2}', {})[f'w{i}'] = np.asarray(values, dtype)
  return tree


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(tree=trees(), data=st.data())
def test_a_saved_tree_loads_exactly_or_its_damage_is_named(tree, data, tmp_path_factory):
  path = str(tmp_path_factory.mktemp('trees') / 'tree.safetensors')
  checkpoint.save_tree(path, tree, {'note': 'x'})
  loaded, meta = checkpoint.load_tree(path)
  assert meta == {'note': 'x'}
  for key, leaf in tree_lib.flatten(tree).items():
    got = tree_lib.flatten(loaded)[key]
    assert got.dtype == leaf.dtype and got.shape == leaf.shape
    np.testing.assert_array_equal(np.atleast_1d(got).view(np.uint8),
                                  np.atleast_1d(leaf).view(np.uint8))
  size = os.path.getsize(path)
  cut = data.draw(st.integers(0, size - 1))
  with open(path, 'rb') as f:
    head = f.read(cut)
  with open(path, 'wb') as f:
    f.write(head)
  with pytest.raises(UserError, match='tree.safetensors is not a readable safetensors file'):
    checkpoint.load_tree(path)
  floats = [k for k, v in tree_lib.flatten(tree).items() if v.dtype != np.int32]
  if floats:
    bad = data.draw(st.sampled_from(floats))
    flat = tree_lib.flatten(tree)
    flat[bad] = np.array(flat[bad])
    flat[bad].flat[data.draw(st.integers(0, flat[bad].size - 1))] = np.nan
    checkpoint.save_tree(path, tree_lib.unflatten(flat))
    with pytest.raises(UserError, match=f'{bad} holds non-finite'):
      checkpoint.load_tree(path)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(tree=trees(), data=st.data())
def test_task_vectors_combine_or_name_the_mismatched_path(tree, data):
  tree = jax.tree.map(lambda x: x.astype(np.float32), tree)
  other = tree_lib.flatten(tree)
  path = data.draw(st.sampled_from(sorted(other)))
  change = data.draw(st.sampled_from(('none', 'reshape', 'drop', 'add')))
  if change == 'reshape':
    other[path] = np.zeros(other[path].shape + (2,), np.float32)
  elif change == 'drop' and len(other) > 1:
    del other[path]
  elif change == 'add':
    other[path + '_extra'] = np.ones(3, np.float32)
  a = TaskVector(tree, ('a',), 'full', 'base')
  b = TaskVector(tree_lib.unflatten(other), ('b',), 'full', 'base')
  if tree_lib.first_mismatch(a.delta, b.delta) is None:
    total = a + b
    for key, leaf in tree_lib.flatten(total.delta).items():
      np.testing.assert_array_equal(leaf, 2 * tree_lib.flatten(tree)[key])
  else:
    with pytest.raises(UserError, match='differ at layer_'):
      a + b


def test_records_leave_accumulation_out_at_its_default():
  """Workdirs recorded before `accumulation` existed still match a config at its default."""
  config = tiny()
  assert 'accumulation' not in experiment.training_record(config.finetune)
  config.finetune.accumulation = 2
  assert experiment.training_record(config.finetune)['accumulation'] == 2
