"""End to end on the tiny config: the whole chain, its outputs, reuse on rerun, config errors."""

import json
import os

import pytest

from configs import quickstart as quickstart_config
from launch import common
from launch import quickstart


@pytest.fixture(scope='module', name='tiny_run')
def tiny_run_fixture(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('quickstart'))
  config = quickstart_config.get_config('tiny')
  return config, workdir, quickstart.run(config, workdir)


def test_quickstart_writes_results_report_and_plot(tiny_run):
  config, workdir, results = tiny_run
  tasks = common.tasks(config)
  with open(os.path.join(workdir, 'results.json')) as f:
    saved = json.load(f)
  assert saved['tasks'] == tasks and set(saved['seconds']) >= {'pretrain', 'finetune', 'total'}
  assert 0 <= saved['addition']['alpha'] <= 1
  for t in tasks:
    assert 0 <= saved['addition']['test'][t] <= 1
    assert 0 <= saved['negation'][t]['target_test'] <= 1
    assert os.path.exists(common.task_vector_file(workdir, 'full', t))
  report = open(os.path.join(workdir, 'report.md')).read()
  assert all(f'| {t} |' in report for t in tasks) and '| mean |' in report
  with open(os.path.join(workdir, 'alpha_curves.png'), 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  assert results['addition'] == saved['addition']


def test_rerun_reuses_finished_work(tiny_run):
  config, workdir, _ = tiny_run
  files = [common.pretrained_file(workdir)] + [
      common.task_vector_file(workdir, 'full', t) for t in common.tasks(config)]
  before = {f: os.stat(f).st_mtime_ns for f in files}
  results = quickstart.run(config, workdir)
  assert {f: os.stat(f).st_mtime_ns for f in files} == before
  assert results['seconds']['finetune'] < 30


def test_a_changed_config_in_the_same_workdir_is_refused(tiny_run):
  config, workdir, _ = tiny_run
  changed = quickstart_config.get_config('tiny')
  changed.finetune.learning_rate = 1.0
  expected = r'other settings \(finetune.learning_rate: 0.001 then, 1.0 now\)'
  with pytest.raises(ValueError, match=expected):
    quickstart.run(changed, workdir)


def test_unknown_config_key_fails_with_a_clear_message(run_python, tmp_path):
  proc = run_python(['-m', 'launch.quickstart', '--config=configs/quickstart.py:tiny',
                     f'--workdir={tmp_path}', '--config.finetune.stepz=3'], check=False)
  assert proc.returncode != 0 and 'stepz' in proc.stderr
  proc = run_python(['-m', 'launch.quickstart', '--config=configs/quickstart.py:tiny',
                     f'--workdir={tmp_path}', '--config.finetune.steps=many'], check=False)
  assert proc.returncode != 0 and 'many' in proc.stderr
  assert not os.listdir(tmp_path)


def test_unknown_task_is_named(tmp_path):
  config = quickstart_config.get_config('tiny')
  config.suite.tasks = 'digits,colours'
  with pytest.raises(ValueError, match='config.suite.tasks: unknown task.*colours'):
    quickstart.run(config, str(tmp_path))
