"""Nothing lost, nothing mixed: what a job refuses, what it locks, and how it says so."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from editing.errors import UserError
from editing import lock
from merging import checkpoints
from merging.checkpoints import tensors
from merging.mergekit import reader as mergekit_reader
from tests import checkpoint_reference as reference
from tests.conftest import REPO
from tests.test_checkpoint_merging import fixture, output_bytes

TIES = checkpoints.Plan('ties', {'density': 0.3, 'scope': 'tensor'}, shard_bytes=2500)


@pytest.fixture(scope='module', name='models')
def models_fixture(tmp_path_factory):
  """(base, fine-tunes) of the small Llama-shaped fixture, made once: copy before changing."""
  return fixture(str(tmp_path_factory.mktemp('models')))


def test_an_existing_output_is_refused_and_kept(tmp_path, models):
  base, tuned = models
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'notes.txt').write_text('mine')
  with pytest.raises(UserError, match=f'config.output = {out} exists.*config.overwrite'):
    checkpoints.merge(base, tuned, str(out), TIES)
  assert os.listdir(out) == ['notes.txt'] and not os.path.exists(f'{out}.partial')
  checkpoints.merge(base, tuned, str(out), TIES, overwrite=True)
  assert 'notes.txt' not in os.listdir(out)
  np.testing.assert_array_equal(reference.read_output(str(out))['lm_head.weight'],
                                reference.in_memory(base, tuned, TIES)['lm_head.weight'])


def test_the_same_merge_again_keeps_its_output(tmp_path, models):
  base, tuned = models
  out = str(tmp_path / 'out')
  checkpoints.merge(base, tuned, out, TIES)
  before = output_bytes(out)
  stamp = os.stat(os.path.join(out, checkpoints.job.RECORD)).st_mtime_ns
  assert checkpoints.merge(base, tuned, out, TIES)['seconds'] == 0.0
  assert output_bytes(out) == before
  assert os.stat(os.path.join(out, checkpoints.job.RECORD)).st_mtime_ns == stamp
  with pytest.raises(UserError, match='exists and is not this merge'):
    checkpoints.merge(base, tuned, out, checkpoints.Plan('task_arithmetic', {}))


@pytest.mark.parametrize('where', ['base', 'inside base', 'parent of base', 'a fine-tune'])
def test_an_output_over_an_input_is_refused_even_with_overwrite(tmp_path, where):
  base, tuned = fixture(str(tmp_path))
  before = output_bytes(base)
  out = {'base': base, 'inside base': os.path.join(base, 'merged'),
         'parent of base': str(tmp_path), 'a fine-tune': tuned[1]}[where]
  with pytest.raises(UserError, match='overlaps the input'):
    checkpoints.merge(base, tuned, out, TIES, overwrite=True)
  assert output_bytes(base) == before
  assert not os.path.exists(os.path.join(base, 'merged'))


def test_an_output_path_that_is_a_file_is_refused(tmp_path, models):
  base, tuned = models
  (tmp_path / 'out').write_text('a file')
  with pytest.raises(UserError, match='is a file'):
    checkpoints.merge(base, tuned, str(tmp_path / 'out'), TIES)
  assert not os.path.exists(tmp_path / 'out.partial')


@pytest.mark.parametrize('settings', [
    dict(scale=float('nan')), dict(scale=float('inf')), dict(weights=(1.0, float('nan'), 1.0)),
    dict(shard_bytes=0), dict(seed=-1)])
def test_a_bad_number_is_refused_before_anything_is_written(tmp_path, models, settings):
  base, tuned = models
  with pytest.raises(UserError, match='config.'):
    checkpoints.merge(base, tuned, str(tmp_path / 'out'),
                      checkpoints.Plan('task_arithmetic', {}, **settings))
  assert os.listdir(tmp_path) == []


def test_a_merge_that_overflows_its_output_dtype_is_refused_and_leaves_nothing(tmp_path, models):
  base, tuned = models
  huge = checkpoints.Plan('task_arithmetic', {}, scale=1e6, dtype='float16')
  with pytest.raises(UserError, match='the merged .* holds non-finite values .*config.scale'):
    checkpoints.merge(base, tuned, str(tmp_path / 'out'), huge)
  assert [f for f in os.listdir(tmp_path) if not f.endswith('.lock')] == []
  allowed = checkpoints.Plan('task_arithmetic', {}, scale=1e6, dtype='float16',
                             allow_nonfinite=True)
  checkpoints.merge(base, tuned, str(tmp_path / 'out'), allowed)
  merged = reference.read_output(str(tmp_path / 'out'))['lm_head.weight']
  assert merged.dtype == np.float16 and not np.isfinite(merged.astype(np.float32)).all()


def test_a_shape_mismatch_is_refused_before_anything_is_written(tmp_path):
  base, tuned = fixture(str(tmp_path / 'models'))
  shutil.copy(os.path.join(tuned[0], 'model.safetensors'), tmp_path / 'keep')
  from editing.models import hf  # pylint: disable=g-import-not-at-top
  tensors_of = reference.read_output(tuned[2])
  tensors_of['model.norm.weight'] = np.zeros(3, np.float32)
  hf.save(tuned[2], tensors_of, {'model_type': 'llama'}, shard_bytes=10**9)
  with pytest.raises(UserError, match=r'ft2: model.norm.weight is float32\[3\]'):
    checkpoints.merge(base, tuned, str(tmp_path / 'out'), TIES)
  assert not os.path.exists(tmp_path / 'out.partial')


def interrupted(base, tuned, out, plan, after_blocks):
  """Runs the merge and kills it (an exception where a SIGKILL would stop it) after
  `after_blocks` blocks: its partial directory stays, as a killed job's does."""
  original = tensors.TensorMerge.block
  count = {'n': 0}

  def block(*args):
    count['n'] += 1
    if count['n'] > after_blocks:
      raise KeyboardInterrupt('killed')
    return original(*args)

  tensors.TensorMerge.block = block
  try:
    checkpoints.merge(base, tuned, out, plan)
  except KeyboardInterrupt:
    pass
  finally:
    tensors.TensorMerge.block = original


def test_a_rerun_under_other_settings_refuses_the_partial_output(tmp_path, models):
  base, tuned = models
  out = str(tmp_path / 'out')
  interrupted(base, tuned, out, TIES, after_blocks=8)
  shards = [f for f in os.listdir(out + '.partial') if f.startswith('model-')]
  assert shards, 'no shard finished before the kill'
  with pytest.raises(UserError, match=r"out.partial holds part of another merge \(method: "
                                      r"'ties' then, 'task_arithmetic' now\); remove it"):
    checkpoints.merge(base, tuned, out, checkpoints.Plan('task_arithmetic', {},
                                                         shard_bytes=2500))
  with pytest.raises(UserError, match=r"settings: .*'density': 0.3.* then, .*'density': 0.5"):
    checkpoints.merge(base, tuned, out, checkpoints.Plan(
        'ties', {'density': 0.5, 'scope': 'tensor'}, shard_bytes=2500))
  assert sorted(f for f in os.listdir(out + '.partial') if f.startswith('model-')) == \
      sorted(shards)


def test_a_rerun_on_changed_inputs_refuses_the_partial_output(tmp_path):
  base, tuned = fixture(str(tmp_path / 'models'))
  out = str(tmp_path / 'out')
  interrupted(base, tuned, out, TIES, after_blocks=8)
  from editing.models import hf  # pylint: disable=g-import-not-at-top
  hf.save(tuned[1], reference.read_output(tuned[0]), {'model_type': 'llama'}, shard_bytes=10**9)
  with pytest.raises(UserError, match=r'ft1 has changed since'):
    checkpoints.merge(base, tuned, out, TIES)
  with pytest.raises(UserError, match=r'inputs: .* then, .* now'):
    checkpoints.merge(base, tuned[:2], out, TIES)


KILL_POINTS = st.integers(min_value=0, max_value=40)
CHANGES = st.sampled_from(['none', 'density', 'method', 'scale', 'input'])


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(kill=KILL_POINTS, change=CHANGES)
def test_a_rerun_completes_with_its_own_bits_or_refuses(tmp_path_factory, kill, change):
  """Killed anywhere, then rerun with or without a change: the rerun either writes the bits
  of an uninterrupted run of its own plan and inputs, or refuses naming the difference; it
  never mixes shards of two merges."""
  root = tmp_path_factory.mktemp('kill')
  base, tuned = fixture(str(root / 'models'))
  out = str(root / 'out')
  interrupted(base, tuned, out, TIES, after_blocks=kill)
  plan = {'none': TIES, 'input': TIES,
          'density': checkpoints.Plan('ties', {'density': 0.6, 'scope': 'tensor'},
                                      shard_bytes=2500),
          'method': checkpoints.Plan('task_arithmetic', {}, shard_bytes=2500),
          'scale': checkpoints.Plan('ties', TIES.settings, scale=0.5, shard_bytes=2500)}[change]
  if change == 'input':
    from editing.models import hf  # pylint: disable=g-import-not-at-top
    hf.save(tuned[0], reference.read_output(tuned[2]), {'model_type': 'llama'},
            shard_bytes=10**9)
  started = os.path.exists(out + '.partial') or os.path.exists(out)
  try:
    checkpoints.merge(base, tuned, out, plan)
  except UserError as e:
    assert started and change != 'none', f'refused a rerun of the same merge: {e}'
    assert 'holds part of another merge' in str(e) or 'is not this merge' in str(e)
    return
  clean = str(root / 'clean')
  checkpoints.merge(base, tuned, clean, plan)
  assert output_bytes(out) == output_bytes(clean)


def test_a_locked_output_or_workdir_is_refused_naming_its_holder(tmp_path, models, run_python):
  base, tuned = models
  out = str(tmp_path / 'out')
  with lock.held(os.path.join(str(tmp_path), '.out.lock'), 'the output'):
    with pytest.raises(UserError, match=f'in use by pid {os.getpid()} on .*, started 20'):
      checkpoints.merge(base, tuned, out, TIES)
  assert not os.path.exists(out + '.partial')
  workdir = str(tmp_path / 'workdir')
  with lock.workdir(workdir):
    proc = run_python(['-m', 'launch.pretrain', f'--workdir={workdir}',
                       '--config=configs/quickstart.py:tiny'], check=False)
    assert os.listdir(workdir) == ['.lock']
  assert proc.returncode == 1, proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(
      f'error: workdir {workdir} is in use by pid {os.getpid()}')
  assert not os.path.exists(workdir), 'the lock left the workdir it made'


def test_two_merges_at_once_one_refused_the_other_intact(tmp_path, models):
  """Two processes merge into one output at the same time: at most one writes, and the
  output is the bits of a single run."""
  base, tuned = models
  out = str(tmp_path / 'out')
  script = textwrap.dedent(f'''
      from merging import checkpoints
      checkpoints.merge({base!r}, {tuned!r}, {out!r}, checkpoints.Plan(
          'ties', {{'density': 0.3, 'scope': 'tensor'}}, shard_bytes=2500))''')
  env = dict(os.environ, PYTHONPATH=REPO)
  procs = [subprocess.Popen([sys.executable, '-c', script], cwd=REPO, env=env,
                            stderr=subprocess.PIPE, text=True) for _ in range(2)]
  results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
  refused = [err for code, err in results if code]
  assert all('in use by pid' in err for err in refused), refused
  checkpoints.merge(base, tuned, str(tmp_path / 'single'), TIES)
  assert output_bytes(out) == output_bytes(str(tmp_path / 'single'))


def test_a_yaml_naming_a_missing_model_names_its_entry(tmp_path, models):
  base, tuned = models
  recipe = tmp_path / 'merge.yaml'
  recipe.write_text(f'models:\n  - model: {tuned[0]}\n  - model: {tmp_path}/nosuch\n'
                    f'merge_method: ties\nbase_model: {base}\n')
  with pytest.raises(UserError, match=rf'{recipe}: models\[1\].model = {tmp_path}/nosuch: no '
                                      'such directory or file'):
    mergekit_reader.read(str(recipe))
  recipe.write_text(f'models:\n  - model: {tuned[0]}\nmerge_method: ties\n'
                    f'base_model: {tmp_path}/nobase\n')
  with pytest.raises(UserError, match=r'base_model = .*/nobase: no such directory'):
    mergekit_reader.read(str(recipe))


FAILING_JOB = r'''
import errno, sys, time
from configs import quickstart
from editing import train
from editing.jobs import cli

what = sys.argv.pop()  # the failure to show, taken before absl reads the flags


def job(config, workdir):
  if what == 'permission':
    raise PermissionError(errno.EACCES, 'Permission denied', '/data/out')
  if what == 'read-only':
    raise OSError(errno.EROFS, 'Read-only file system', '/mnt/ro/workdir')
  if what == 'preempted':
    raise train.Preempted('SIGTERM: saved step 7 in /w; rerun to resume')
  if what == 'wait':
    open(workdir + '/ready', 'w').close()
    time.sleep(60)
  raise RuntimeError('a bug')

cli.run(job, quickstart)
'''


@pytest.mark.parametrize('what, status, line', [
    ('permission', 1, 'error: /data/out: Permission denied; check its permissions'),
    ('read-only', 1, 'error: /mnt/ro/workdir: Read-only file system; its file system is '
                     'read-only'),
    ('preempted', 143, 'error: SIGTERM: saved step 7 in /w; rerun to resume'),
])
def test_user_errors_end_in_one_line(tmp_path, run_python, what, status, line):
  proc = run_python(['-c', FAILING_JOB, f'--workdir={tmp_path}', what], check=False)
  assert proc.returncode == status and 'Traceback' not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(line)


def test_a_bug_keeps_its_traceback(tmp_path, run_python):
  proc = run_python(['-c', FAILING_JOB, f'--workdir={tmp_path}', 'bug'], check=False)
  assert proc.returncode == 1 and 'Traceback' in proc.stderr and 'RuntimeError: a bug' in \
      proc.stderr


def test_sigterm_outside_training_ends_in_one_line_with_status_143(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO)
  proc = subprocess.Popen([sys.executable, '-c', FAILING_JOB, f'--workdir={tmp_path}', 'wait'],
                          cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while not os.path.exists(tmp_path / 'ready') and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=60)
  assert proc.returncode == 143 and 'Traceback' not in stderr, stderr
  assert stderr.strip().splitlines()[-1].startswith('error: stopped by SIGTERM')


@pytest.mark.parametrize('args, failing', [
    (['-m', 'launch.merge_checkpoints', '--config.metod=ties', '--config.scale=2'],
     '--config.metod=ties'),
    (['-m', 'launch.quickstart', '--config.finetune.stepz=3'], '--config.finetune.stepz=3'),
    (['-m', 'launch.merge_checkpoints', '--config=configs/merge_checkpoints.py',
      '--config.scale=2', '--config.ties.keep=x'], '--config.ties.keep=x'),
])
def test_a_bad_override_is_one_line_naming_it(tmp_path, run_python, args, failing):
  proc = run_python(args + [f'--workdir={tmp_path}/w'], check=False)
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == \
      next(line for line in proc.stderr.splitlines() if line.startswith('error:'))
  assert f'a config override ({failing}) fails' in proc.stderr
  assert not os.path.exists(f'{tmp_path}/w')


def test_the_record_of_a_merge_says_what_made_it(tmp_path, models):
  base, tuned = models
  out = str(tmp_path / 'out')
  checkpoints.merge(base, tuned, out, TIES)
  with open(os.path.join(out, checkpoints.job.RECORD)) as f:
    record = json.load(f)
  assert record['plan']['method'] == 'ties'
  assert record['plan']['settings'] == {'density': 0.3, 'scope': 'tensor', 'normalize': True}
  assert [i['path'] for i in record['inputs']] == [os.path.abspath(p) for p in [base, *tuned]]


def test_sigterm_in_training_saves_and_ends_in_one_line_with_status_143(tmp_path):
  """Through the launch job: the step is saved, and the line says which and how to resume
  (resuming itself is tested in test_train)."""
  env = dict(os.environ, PYTHONPATH=REPO)
  args = [sys.executable, '-m', 'launch.pretrain', '--config=configs/quickstart.py:tiny',
          f'--workdir={tmp_path}', '--config.pretrain.steps=5000',
          '--config.pretrain.checkpoint_every=10000']
  proc = subprocess.Popen(args, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
  metrics = tmp_path / 'pretrain' / 'metrics.jsonl'
  deadline = time.time() + 300
  while not (metrics.exists() and metrics.stat().st_size) and time.time() < deadline:
    assert proc.poll() is None, proc.stderr.read()
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 143 and 'Traceback' not in stderr, stderr
  last = stderr.strip().splitlines()[-1]
  assert last.startswith('error: SIGTERM: saved step ') and 'rerun to resume' in last, last
