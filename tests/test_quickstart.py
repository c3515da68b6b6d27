"""End to end on the tiny config: the whole chain, its outputs, reuse on rerun, config errors."""

import json
import os
import shutil

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

import merging
from configs import merge as merge_config
from configs import quickstart as quickstart_config
from editing import checkpoint
from editing import tree as tree_lib
from editing.errors import UserError
from editing.jobs import experiment
from editing.jobs import finetune
from editing.jobs import quickstart
from editing.jobs import workdir as workdir_lib
from merging import ties
from merging.jobs import merge
from merging.jobs import safety
from tests.conftest import REPO
from tests.conftest import TINY_REGIMES as REGIMES


PNG = b'\x89PNG\r\n\x1a\n'


def test_quickstart_writes_results_reports_and_plots_for_every_regime(tiny_run):
  config, workdir, results = tiny_run
  tasks = experiment.tasks(config)
  with open(os.path.join(workdir, 'results.json')) as f:
    saved = json.load(f)
  assert saved['tasks'] == tasks and tuple(saved['regimes']) == REGIMES
  assert set(saved['seconds']) >= {'pretrain', 'finetune_full', 'finetune_talos', 'total'}
  comparison = open(os.path.join(workdir, 'report.md')).read()
  for regime in REGIMES:
    for t in tasks:
      assert os.path.exists(workdir_lib.task_vector_file(workdir, regime, t))
    directory = workdir_lib.evaluation_dir(workdir, regime)
    report = open(os.path.join(directory, 'report.md')).read()
    assert all(f'| {t} |' in report for t in tasks) and '| mean |' in report
    assert f'keeps ≥ {100 * config.eval.negation_threshold:g}% of its pretrained' in report
    for plot in ('alpha_curves.png', 'disentanglement.png'):
      with open(os.path.join(directory, plot), 'rb') as f:
        assert f.read(8) == PNG, plot
    assert f'| {regime} |' in comparison
  assert results['regimes']['full']['addition'] == saved['regimes']['full']['addition']


@pytest.mark.parametrize('regime', REGIMES)
def test_quickstart_results_follow_the_protocols(tiny_run, regime):
  """What each number must be, recomputed from the saved task vectors and the curves."""
  config, workdir, results = tiny_run
  result = results['regimes'][regime]
  tasks = result['tasks']
  # Addition: α is the first best of the validation curve, and its test accuracies are what a
  # fresh evaluator measures there on the saved vectors.
  addition = result['addition']
  best = max(addition['curve'], key=lambda p: p['normalized_val'])
  assert addition['alpha'] == best['alpha']
  theta0, apply_fn = experiment.load_pretrained(workdir)
  evaluator = experiment.evaluator(config, apply_fn, regime)
  vectors = [checkpoint.load_task_vector(workdir_lib.task_vector_file(workdir, regime, t))[0]
             for t in tasks]
  params = evaluator.edit(theta0, sum(vectors), addition['alpha'])
  for t in tasks:
    task = experiment.load_task(config, t)
    head = experiment.head(config, workdir, task, theta0, apply_fn)
    assert addition['test'][t] == evaluator.accuracy(theta0, params, head, task.test)
    assert addition['normalized_test'][t] == pytest.approx(
        addition['test'][t] / result['finetuned'][t]['test'])
  # Negation: the least target accuracy among the α that keep the control's floor.
  for t in tasks:
    negation = result['negation'][t]
    floor = config.eval.negation_threshold * negation['curve'][0]['control_val']
    feasible = [p for p in negation['curve'] if p['control_val'] >= floor]
    chosen = next(p for p in negation['curve'] if p['alpha'] == negation['alpha'])
    assert chosen in feasible
    assert chosen['target_val'] == min(p['target_val'] for p in feasible)
  # ξ(0, 0) compares θ0 with itself: exactly 0.
  xi = result['disentanglement']
  assert list(xi['xi']) == ['digits:colour'] and xi['alphas'] == [-2.0, 0.0, 2.0]
  assert xi['xi']['digits:colour'][1][1] == 0.0
  assert xi['mean'] == pytest.approx(np.mean(xi['xi']['digits:colour']))


def test_talos_masks_are_saved_with_their_task_vectors(tiny_run):
  config, workdir, _ = tiny_run
  for t in experiment.tasks(config):
    mask_file = workdir_lib.update_mask_file(workdir, 'talos', t)
    _, meta = checkpoint.load_task_vector(workdir_lib.task_vector_file(workdir, 'talos', t))
    assert meta['update_mask'] == os.path.basename(mask_file)
    mask = tree_lib.flatten(checkpoint.load_tree(mask_file)[0])
    kept, total = sum(int(m.sum()) for m in mask.values()), sum(m.size for m in mask.values())
    assert kept == round(config.talos.keep * total)
    delta = tree_lib.flatten(checkpoint.load_task_vector(
        workdir_lib.task_vector_file(workdir, 'talos', t))[0].delta)
    for path, value in delta.items():
      outside = ~mask[path] if path in mask else np.ones(value.shape, bool)
      assert not value[outside].any(), path


def test_rerun_reuses_finished_work(tiny_run):
  config, workdir, first = tiny_run
  files = [workdir_lib.pretrained_file(workdir)] + [workdir_lib.task_vector_file(workdir, r, t)
                                                     for r in REGIMES
                                                     for t in experiment.tasks(config)]
  before = {f: os.stat(f).st_mtime_ns for f in files}
  results = quickstart.run(config, workdir)
  assert {f: os.stat(f).st_mtime_ns for f in files} == before
  assert results['regimes'] == first['regimes']


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


def ties_grid(config) -> list[dict]:
  """The TIES settings a sweep tries: each density of its one axis, config.sweep.ties.density,
  in order, beside the values config.ties gives (none for the density) and TIES' declared
  defaults of the rest."""
  axes = [k for k, v in config.sweep.ties.items() if v is not None]
  assert axes == ['density'] and config.ties.density is None, (axes, config.ties.density)
  values = {**{k: s.default for k, s in ties.merge.settings.items()},
            **{k: v for k, v in config.ties.items() if v is not None}}
  return [{**values, 'density': d} for d in config.sweep.ties.density]


def assert_ties_chosen_on_validation(config, workdir, regime, result):
  """A sweep's TIES `result` holds the first setting of the grid and the first λ of its grid
  with the best mean normalized validation accuracy (each task's accuracy over its fine-tuned
  model's), re-measured here for every setting and λ; its test accuracies are the chosen
  merge's there."""
  tasks = experiment.tasks(config)
  theta0, apply_fn = experiment.load_pretrained(workdir)
  evaluator = experiment.evaluator(config, apply_fn, regime)
  vectors = [checkpoint.load_task_vector(workdir_lib.task_vector_file(workdir, regime, t))[0]
             for t in tasks]
  data = {t: experiment.load_task(config, t) for t in tasks}
  heads = {t: experiment.head(config, workdir, data[t], theta0, apply_fn) for t in tasks}
  finetuned = {t: evaluator.accuracy(theta0, evaluator.edit(theta0, v, 1.0), heads[t],
                                     data[t].val) for t, v in zip(tasks, vectors)}
  # λ on 0, step, ..., the lambda_max that TIES' registry entry declares.
  step, stop = config.merge.lambda_step, merging.get('ties').lambda_max
  lambdas = [round(i * step, 10) for i in range(round(stop / step) + 1)]
  sweep = []
  for settings in ties_grid(config):
    merged = ties.merge(vectors, **settings)
    curve = [float(np.mean([evaluator.accuracy(theta0, evaluator.edit(theta0, merged, lam),
                                               heads[t], data[t].val) / finetuned[t]
                            for t in tasks])) for lam in lambdas]
    sweep.append((settings, merged, curve))
  best = max(max(curve) for _, _, curve in sweep)
  settings, merged, curve = next(s for s in sweep if max(s[2]) == best)
  assert result['hyperparameters'] == settings, [(s, max(c)) for s, _, c in sweep]
  assert result['normalized_val'] == pytest.approx(best)
  assert result['lambda'] == pytest.approx(lambdas[curve.index(best)])
  params = evaluator.edit(theta0, merged, result['lambda'])
  for t in tasks:
    assert result['test'][t] == evaluator.accuracy(theta0, params, heads[t], data[t].test), t


def test_merge_job_merges_evaluates_and_saves_every_method(tiny_run):
  _, workdir, _ = tiny_run
  config = merge_config.get_config('tiny')
  config.regimes = 'talos'
  config.merge.methods = ','.join(MERGE_METHODS)
  config.sweep.ties.density = (0.1, 0.3)
  summary = merge.run(config, workdir)['talos']
  directory = workdir_lib.merge_dir(workdir, 'talos')
  with open(os.path.join(directory, 'results.json')) as f:
    assert json.load(f)['methods'].keys() == set(MERGE_METHODS)
  ties_result = summary['methods']['ties']
  assert ties_result['swept'] == ['density']
  assert_ties_chosen_on_validation(config, workdir, 'talos', ties_result)
  assert summary['methods']['averaging']['lambda'] == 1.0
  for name, result in summary['methods'].items():
    assert result['mean_test'] == pytest.approx(np.mean(list(result['test'].values())))
    for t, accuracy in result['test'].items():
      assert result['normalized_test'][t] == pytest.approx(
          accuracy / summary['finetuned'][t]['test'])
    restored = ocp.StandardCheckpointer().restore(os.path.join(directory, name, 'params'))
    assert tree_lib.first_mismatch(restored, checkpoint.load_tree(
        workdir_lib.pretrained_file(workdir))[0]) is None
  report = open(os.path.join(directory, 'report.md')).read()
  ranked = [line.split(' | ')[0].strip('| ') for line in report.splitlines()
            if line.split(' | ')[0].strip('| ') in MERGE_METHODS]
  means = [summary['methods'][m]['mean_normalized_test'] for m in ranked]
  assert len(ranked) == len(MERGE_METHODS) and means == sorted(means, reverse=True)
  # A rerun with the same settings reuses every result; other settings redo that method only.
  again = merge.run(config, workdir)['talos']
  assert again['methods'] == json.loads(json.dumps(summary['methods']))
  config.sweep.ties.density = (0.5,)
  changed = merge.run(config, workdir)['talos']['methods']
  assert changed['ties']['hyperparameters']['density'] == 0.5
  assert changed['fisher'] == again['methods']['fisher']
  # Another method list reruns nothing that is done, and the report keeps every method merged
  # under the current settings.
  results = {m: os.path.join(directory, m, 'result.json') for m in MERGE_METHODS}
  stamps = {m: os.stat(f).st_mtime_ns for m, f in results.items()}
  config.merge.methods = 'averaging'
  listed = merge.run(config, workdir)['talos']['methods']
  assert set(listed) == set(MERGE_METHODS) and listed['ties'] == changed['ties']
  assert {m: os.stat(f).st_mtime_ns for m, f in results.items()} == stamps
  # Nor do the settings of what runs beside the sweep (the continual protocol, the linearity
  # diagnostic) change a result.
  config.eval.linearity_alphas, config.merge.orders = '1', 2
  assert set(merge.run(config, workdir)['talos']['methods']) == set(MERGE_METHODS)
  assert {m: os.stat(f).st_mtime_ns for m, f in results.items()} == stamps
  config.eval.linearity_alphas, config.merge.orders = '', 3
  report = open(os.path.join(directory, 'report.md')).read()
  assert all(f'| {m} |' in report for m in MERGE_METHODS)
  # A method's result under other settings is not listed.
  config.fisher.batch_size = 16
  assert 'fisher' not in merge.run(config, workdir)['talos']['methods']


def test_a_non_finite_merge_is_refused_before_it_is_applied_or_saved(tiny_run, tmp_path,
                                                                     monkeypatch):
  _, source, _ = tiny_run
  workdir = str(tmp_path / 'workdir')
  shutil.copytree(source, workdir)
  nan_merge = lambda vectors: vectors[0].replace(
      delta=jax.tree.map(lambda d: d * np.nan, vectors[0].delta))
  monkeypatch.setitem(merging.REGISTRY, 'averaging', merging.Method(nan_merge, scaled=False))
  config = merge_config.get_config('tiny')
  config.regimes, config.merge.methods = 'full', 'averaging'
  with pytest.raises(UserError, match='the averaging merge with defaults: .* holds non-finite'):
    merge.run(config, workdir)
  directory = os.path.join(workdir_lib.merge_dir(workdir, 'full'), 'averaging')
  assert not os.path.exists(os.path.join(directory, 'params'))
  assert not os.path.exists(os.path.join(directory, 'result.json'))


def test_merge_refuses_unknown_methods_settings_and_what_a_regime_cannot_merge():
  """What the merge job refuses before it reads a workdir. (How a grid is built from
  config.sweep and each value checked: tests/test_settings.py.)"""
  config = merge_config.get_config('tiny')
  config.merge.methods = 'ties,tie'
  with pytest.raises(ValueError, match=r"config.merge.methods: unknown method\(s\) \['tie'\]"):
    merge.run(config, '/nonexistent')
  config.merge.methods = 'ties,regmean'
  config.regimes = 'linearized'
  with pytest.raises(ValueError, match=r"\['regmean'\] cannot merge linearized"):
    merge.run(config, '/nonexistent')
  config.regimes = 'full'
  config.merge.methods = 'dam_oracle'
  with pytest.raises(ValueError, match='dam_oracle.*true backdoor trigger'):
    merge.run(config, '/nonexistent')
  config.merge.methods = 'ties'
  config.sweep.ties = ml_collections.ConfigDict(dict(densty=(0.1,)))
  with pytest.raises(ValueError,
                     match=r'config.sweep.ties.densty is not a setting of ties.*density'):
    merge.run(config, '/nonexistent')
  config.sweep.ties = ml_collections.ConfigDict(dict(scope=('tensor', 1)))
  with pytest.raises(ValueError, match=r"config.sweep.ties.scope = 1: must be one of"):
    merge.run(config, '/nonexistent')
  config.sweep.ties = ml_collections.ConfigDict(dict(density=(0.1, '0.2')))
  with pytest.raises(ValueError, match=r"config.sweep.ties.density = '0.2': must be a number in"):
    merge.run(config, '/nonexistent')
  config.sweep.ties = ml_collections.ConfigDict(dict(density=(0.1, 0.2)))
  config.ties.density = 0.2
  with pytest.raises(ValueError, match=r'^config.ties.density = 0.2 and config.sweep.ties.density '
                                       r'= \(0.1, 0.2\) both set it; give one$'):
    merge.run(config, '/nonexistent')
  config.sweep.ties = ml_collections.ConfigDict()
  config.ties = ml_collections.ConfigDict(dict(densty=0.1))
  with pytest.raises(ValueError, match=r'config.ties.densty is not a setting.*density'):
    merge.run(config, '/nonexistent')


def readme_library_example() -> str:
  """The python block of the README's "Use it as a library" section."""
  with open(os.path.join(REPO, 'README.md')) as f:
    section = f.read().split('## Use it as a library', 1)[1].split('\n## ', 1)[0]
  return section.split('```python\n', 1)[1].split('```', 1)[0]


def test_readme_library_example_runs_and_the_safety_job_scores_asr(tiny_run, tmp_path):
  _, quickstart_workdir, _ = tiny_run
  # The quickstart's backbone, task vectors and compiled programs serve the example.
  workdir = str(tmp_path / 'notebook')
  shutil.copytree(quickstart_workdir, workdir)
  code = readme_library_example()
  assert "workdir = 'workdir/notebook'" in code
  namespace = {}
  exec(code.replace("'workdir/notebook'", repr(workdir)), namespace)  # pylint: disable=exec-used

  sweep = namespace['sweep']
  assert set(sweep['methods']) == {'task_arithmetic', 'ties'}
  # The example's sweep: the tiny merge config with its TIES density grid.
  assert "config = merge_config.get_config('tiny')" in code
  assert 'config.sweep.ties.density = (0.1, 0.2)' in code
  sweep_config = merge_config.get_config('tiny')
  sweep_config.sweep.ties.density = (0.1, 0.2)
  assert_ties_chosen_on_validation(sweep_config, workdir, 'full', sweep['methods']['ties'])
  summary = namespace['attack']
  assert [(r['trigger'], r['poisoned'], r['method']) for r in summary['merges']] == [
      ('badnets', ['digits'], 'task_arithmetic'), ('badnets', ['digits'], 'dam_oracle')]
  for r in summary['merges']:
    assert set(r['asr']) == {'digits', 'colour', 'size'}
    assert r['succession'] == r['asr']['digits']
    assert r['transfer'] == pytest.approx((r['asr']['colour'] + r['asr']['size']) / 2)
    assert r['mean_test'] == pytest.approx(np.mean(list(r['test'].values())))
  seed_dir = os.path.join(workdir_lib.safety_dir(workdir), 'seed_0')
  clean, _ = checkpoint.load_task_vector(os.path.join(seed_dir, 'clean', 'digits',
                                                      workdir_lib.TASK_VECTOR))
  poisoned, meta = checkpoint.load_task_vector(os.path.join(seed_dir, 'badnets', 'digits',
                                                            workdir_lib.TASK_VECTOR))
  assert meta['poison']['trigger'] == 'badnets' and meta['poison']['tasks'] == 'digits'
  assert not np.allclose(clean.delta['proj']['kernel'], poisoned.delta['proj']['kernel'])
  attacks = summary['fine_tunes'][0]
  assert set(attacks) == {'clean/digits', 'clean/colour', 'clean/size', 'badnets/digits'}
  report = open(os.path.join(workdir_lib.safety_dir(workdir), 'report.md')).read()
  assert '| badnets | digits | dam_oracle |' in report
  with open(os.path.join(workdir_lib.safety_dir(workdir), 'scatter.png'), 'rb') as f:
    assert f.read(8) == PNG
  # A rerun reuses every fine-tune and merge.
  config = namespace['config']
  assert safety.run(config, workdir)['merges'] == json.loads(json.dumps(summary['merges']))


def test_a_poisoned_fine_tune_is_refused_where_a_clean_one_was_made(tiny_run):
  config, workdir, _ = tiny_run
  poisoned = quickstart_config.get_config('tiny')
  poisoned.poison.tasks = 'digits'
  with pytest.raises(ValueError, match='poison'):
    finetune.run(poisoned, workdir, 'digits', experiment.regime(poisoned, 'full'))


def test_lora_regimes_fine_tune_evaluate_and_merge_through_the_jobs(tiny_run, tmp_path):
  config, source, _ = tiny_run
  workdir = str(tmp_path / 'workdir')
  shutil.copytree(source, workdir)
  config = quickstart_config.get_config('tiny')
  config.regimes = 'lora,l_lora'
  results = quickstart.run(config, workdir)['regimes']
  tasks = experiment.tasks(config)
  theta0 = checkpoint.load_tree(workdir_lib.pretrained_file(workdir))[0]
  for regime in ('lora', 'l_lora'):
    for t in tasks:
      vector, meta = checkpoint.load_task_vector(workdir_lib.task_vector_file(workdir, regime, t))
      assert vector.low_rank and vector.regime == regime
      assert sorted(meta['low_rank']) == [f'blocks_{i}/attn/{p}/kernel'
                                          for i in range(config.model.depth)
                                          for p in ('query', 'value')]
      assert {d.rank for d in vector.delta.values()} == {config[regime].rank}
    assert set(results[regime]) >= {'addition', 'negation', 'disentanglement'}
    assert results[regime]['finetuned'].keys() == set(tasks)
  lora_config = merge_config.get_config('tiny')
  lora_config.regimes = 'lora'
  lora_config.merge.methods = 'task_arithmetic,ties,knots_ties,peft_cat,peft_svd,lorm'
  methods = merge.run(lora_config, workdir)['lora']['methods']
  assert set(methods) == set(lora_config.merge.methods.split(','))
  # The exact sum of the adapters, as factors and as dense deltas, makes the same edit (up to
  # float rounding, which may flip a prediction at a tie).
  assert methods['peft_cat']['lambda'] == methods['task_arithmetic']['lambda']
  assert methods['peft_cat']['mean_test'] == pytest.approx(
      methods['task_arithmetic']['mean_test'], abs=0.01)
  restored = ocp.StandardCheckpointer().restore(
      os.path.join(workdir_lib.merge_dir(workdir, 'lora'), 'knots_ties', 'params'))
  assert tree_lib.first_mismatch(restored, theta0) is None
  lora_config.regimes, lora_config.merge.methods = 'l_lora', 'regmean'
  with pytest.raises(UserError, match=r"\['regmean'\] cannot merge l_lora"):
    merge.run(lora_config, workdir)
  lora_config.regimes, lora_config.merge.methods = 'full', 'knots_ties'
  with pytest.raises(UserError, match=r"\['knots_ties'\] merge LoRA adapters, and the full"):
    merge.run(lora_config, workdir)
