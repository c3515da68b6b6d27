"""End to end on the tiny config: the whole chain, its outputs, reuse on rerun, config errors."""

import json
import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import merge as merge_config
from configs import quickstart as quickstart_config
from configs import safety as safety_config
from editing import checkpoint
from editing import tree as tree_lib
from launch import common
from launch import finetune
from launch import merge
from launch import quickstart
from launch import safety


@pytest.fixture(scope='module', name='tiny_run')
def tiny_run_fixture(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('quickstart'))
  config = quickstart_config.get_config('tiny')
  config.regimes = ','.join(REGIMES)
  return config, workdir, quickstart.run(config, workdir)


REGIMES = ('full', 'talos')
PNG = b'\x89PNG\r\n\x1a\n'


def test_quickstart_writes_results_reports_and_plots_for_every_regime(tiny_run):
  config, workdir, results = tiny_run
  tasks = common.tasks(config)
  with open(os.path.join(workdir, 'results.json')) as f:
    saved = json.load(f)
  assert saved['tasks'] == tasks and tuple(saved['regimes']) == REGIMES
  assert set(saved['seconds']) >= {'pretrain', 'finetune_full', 'finetune_talos', 'total'}
  comparison = open(os.path.join(workdir, 'report.md')).read()
  for regime in REGIMES:
    result = saved['regimes'][regime]
    assert 0 <= result['addition']['alpha'] <= 1
    for t in tasks:
      assert 0 <= result['addition']['test'][t] <= 1
      assert 0 <= result['negation'][t]['target_test'] <= 1
      assert os.path.exists(common.task_vector_file(workdir, regime, t))
    xi = result['disentanglement']
    assert list(xi['xi']) == ['digits:colour'] and 0 <= xi['mean'] <= 2
    assert np.shape(xi['xi']['digits:colour']) == (3, 3)
    directory = common.evaluation_dir(workdir, regime)
    report = open(os.path.join(directory, 'report.md')).read()
    assert all(f'| {t} |' in report for t in tasks) and '| mean |' in report
    for plot in ('alpha_curves.png', 'disentanglement.png'):
      with open(os.path.join(directory, plot), 'rb') as f:
        assert f.read(8) == PNG, plot
    assert f'| {regime} |' in comparison
  assert results['regimes']['full']['addition'] == saved['regimes']['full']['addition']


def test_talos_masks_are_saved_with_their_task_vectors(tiny_run):
  config, workdir, _ = tiny_run
  for t in common.tasks(config):
    mask_file = common.update_mask_file(workdir, 'talos', t)
    _, meta = checkpoint.load_task_vector(common.task_vector_file(workdir, 'talos', t))
    assert meta['update_mask'] == os.path.basename(mask_file)
    mask = tree_lib.flatten(checkpoint.load_tree(mask_file)[0])
    kept, total = sum(int(m.sum()) for m in mask.values()), sum(m.size for m in mask.values())
    assert kept == round(config.talos.keep * total)
    delta = tree_lib.flatten(checkpoint.load_task_vector(
        common.task_vector_file(workdir, 'talos', t))[0].delta)
    for path, value in delta.items():
      outside = ~mask[path] if path in mask else np.ones(value.shape, bool)
      assert not value[outside].any(), path


def test_rerun_reuses_finished_work(tiny_run):
  config, workdir, _ = tiny_run
  files = [common.pretrained_file(workdir)] + [
      common.task_vector_file(workdir, r, t) for r in REGIMES for t in common.tasks(config)]
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


def test_unknown_regime_is_named(tmp_path):
  config = quickstart_config.get_config('tiny')
  config.regimes = 'full,ntk'
  with pytest.raises(ValueError, match=r"config.regimes: unknown regime\(s\) \['ntk'\]"):
    quickstart.run(config, str(tmp_path))


def test_unknown_task_is_named(tmp_path):
  config = quickstart_config.get_config('tiny')
  config.suite.tasks = 'digits,colours'
  with pytest.raises(ValueError, match='config.suite.tasks: unknown task.*colours'):
    quickstart.run(config, str(tmp_path))


MERGE_METHODS = ('averaging', 'ties', 'fisher', 'adamerging_layer')


def test_merge_job_merges_evaluates_and_saves_every_method(tiny_run):
  _, workdir, _ = tiny_run
  config = merge_config.get_config('tiny')
  config.regimes = 'talos'
  config.merge.methods = ','.join(MERGE_METHODS)
  config.ties.k = '0.1,0.3'
  summary = merge.run(config, workdir)['talos']
  directory = common.merge_dir(workdir, 'talos')
  with open(os.path.join(directory, 'results.json')) as f:
    assert json.load(f)['methods'].keys() == set(MERGE_METHODS)
  assert summary['methods']['ties']['hyperparameters']['k'] in (0.1, 0.3)
  assert summary['methods']['averaging']['lambda'] == 1.0
  for name, result in summary['methods'].items():
    assert 0 <= result['mean_test'] <= 1
    restored = ocp.StandardCheckpointer().restore(os.path.join(directory, name, 'params'))
    assert tree_lib.first_mismatch(restored, checkpoint.load_tree(
        common.pretrained_file(workdir))[0]) is None
  report = open(os.path.join(directory, 'report.md')).read()
  ranked = [line.split(' | ')[0].strip('| ') for line in report.splitlines()
            if line.split(' | ')[0].strip('| ') in MERGE_METHODS]
  means = [summary['methods'][m]['mean_normalized_test'] for m in ranked]
  assert len(ranked) == len(MERGE_METHODS) and means == sorted(means, reverse=True)
  # A rerun with the same settings reuses every result; other settings redo that method only.
  again = merge.run(config, workdir)['talos']
  assert again['methods'] == json.loads(json.dumps(summary['methods']))
  config.ties.k = '0.5'
  changed = merge.run(config, workdir)['talos']['methods']
  assert changed['ties']['hyperparameters']['k'] == 0.5
  assert changed['fisher'] == again['methods']['fisher']


def test_merge_hyperparameter_grids_are_comma_separated():
  config = merge_config.get_config('tiny')
  config.ties.k = '0.1, 0.2'
  config.ties.scope = 'tensor,global'
  grid = merge.hyperparameter_grid(config.ties)
  assert len(grid) == 4 and {'k': 0.2, 'scope': 'tensor'} in grid
  assert merge.hyperparameter_grid(config.fisher) == [{'batch_size': 32}]
  config.merge.methods = 'ties,tie'
  with pytest.raises(ValueError, match=r"config.merge.methods: unknown method\(s\) \['tie'\]"):
    merge.run(config, '/nonexistent')
  config.merge.methods = 'ties,regmean'
  config.regimes = 'linearized'
  with pytest.raises(ValueError, match=r"\['regmean'\] cannot merge linearized"):
    merge.run(config, '/nonexistent')


def test_safety_job_poisons_merges_and_scores_clean_accuracy_and_asr(tiny_run, tmp_path):
  _, quickstart_workdir, _ = tiny_run
  workdir = str(tmp_path)
  shutil.copytree(common.pretrain_dir(quickstart_workdir), common.pretrain_dir(workdir))
  # The quickstart's compiled fine-tuning steps serve the poisoned fine-tunes too.
  shutil.copytree(os.path.join(quickstart_workdir, '.jax_cache'),
                  os.path.join(workdir, '.jax_cache'))
  config = safety_config.get_config('tiny')
  config.safety.update(seeds='0', triggers='badnets', poisoned_counts='1',
                       methods='task_arithmetic,dam_oracle')
  summary = safety.run(config, workdir)
  assert [(r['trigger'], r['poisoned'], r['method']) for r in summary['merges']] == [
      ('badnets', ['digits'], 'task_arithmetic'), ('badnets', ['digits'], 'dam_oracle')]
  for r in summary['merges']:
    assert set(r['asr']) == {'digits', 'colour', 'size'}
    assert r['succession'] == r['asr']['digits']
    assert r['transfer'] == pytest.approx((r['asr']['colour'] + r['asr']['size']) / 2)
    assert 0 <= r['mean_test'] <= 1
  seed_dir = os.path.join(workdir, 'safety', 'seed_0')
  clean, _ = checkpoint.load_task_vector(os.path.join(seed_dir, 'clean', 'digits',
                                                      common.TASK_VECTOR))
  poisoned, meta = checkpoint.load_task_vector(os.path.join(seed_dir, 'badnets', 'digits',
                                                            common.TASK_VECTOR))
  assert meta['poison']['trigger'] == 'badnets' and meta['poison']['tasks'] == 'digits'
  assert not np.allclose(clean.delta['proj']['kernel'], poisoned.delta['proj']['kernel'])
  attacks = summary['fine_tunes'][0]
  assert set(attacks) == {'clean/digits', 'clean/colour', 'clean/size', 'badnets/digits'}
  report = open(os.path.join(workdir, 'safety', 'report.md')).read()
  assert '| badnets | digits | dam_oracle |' in report
  with open(os.path.join(workdir, 'safety', 'scatter.png'), 'rb') as f:
    assert f.read(8) == PNG
  # A rerun reuses every fine-tune and merge.
  assert safety.run(config, workdir)['merges'] == json.loads(json.dumps(summary['merges']))


def test_a_poisoned_fine_tune_is_refused_where_a_clean_one_was_made(tiny_run):
  config, workdir, _ = tiny_run
  poisoned = quickstart_config.get_config('tiny')
  poisoned.poison.tasks = 'digits'
  with pytest.raises(ValueError, match='poison'):
    finetune.run(poisoned, workdir, 'digits', common.regime(poisoned, 'full'))
