"""The recipe search: every point fine-tuned and scored on validation, the best chosen per
regime and placed where the evaluation reads it, resumable, one workdir gathering regimes."""

import json
import os

import numpy as np
import pytest

from configs import recipe_search as recipe_search_config
from editing import checkpoint
from editing import evaluate
from editing import train
from editing.jobs import experiment
from editing.errors import UserError
from editing.jobs import recipe_records
from editing.jobs import recipe_report
from editing.jobs import recipe_search
from editing.jobs import workdir as workdir_lib
from editing.regimes import talos


def tiny_search():
  config = recipe_search_config.get_config('tiny')
  config.suite.tasks = 'colour,size'
  config.eval.disentanglement_pairs = 'colour:size'
  config.sweep.finetune.update(learning_rate=(1e-4, 3e-3), steps=(6,), seed=(0, 1))
  return config


def test_ties_go_to_fewer_steps_then_the_smaller_rate():
  points = [{'learning_rate': lr, 'steps': s, 'mean_val': v}
            for lr, s, v in [(1e-3, 300, 0.9), (1e-3, 100, 0.9), (1e-4, 100, 0.9),
                             (3e-4, 100, 0.8)]]
  assert recipe_search.choose(points) == points[2]
  points.append({'learning_rate': 1e-2, 'steps': 300, 'mean_val': 0.95})
  assert recipe_search.choose(points) == points[-1]
  for p, addition in zip(points, (0.5, 0.7, 0.7, 0.6, 0.4)):
    p['addition_val'] = addition
  assert recipe_search.choose(points, 'addition') == points[2]
  # A point whose addition is unscored (a task it did not learn) is not chosen by addition.
  points[2]['addition_val'] = None
  assert recipe_search.choose(points, 'addition') == points[1]


def searched(scores):
  points = [{'learning_rate': lr, 'steps': n, 'mean_val': v} for (lr, n), v in scores.items()]
  return {'points': points, 'chosen': recipe_search.choose(points), 'complete': True}


def test_a_choice_at_an_end_of_a_searched_range_is_named():
  scores = {(lr, n): 0.5 for lr in (1e-4, 1e-3, 1e-2) for n in (100, 300, 1000)}
  assert recipe_report.at_edge(searched({**scores, (1e-3, 300): 0.9})) == []
  assert recipe_report.at_edge(searched({**scores, (1e-3, 1000): 0.9})) == ['steps']
  assert recipe_report.at_edge(searched({**scores, (1e-2, 100): 0.9})) == [
      'learning_rate', 'steps']
  table = recipe_report.table({'talos': searched({**scores, (1e-3, 1000): 0.9})})
  assert "<- chosen (steps on the grid's edge)" in table
  # Of two values, either is an end: nothing is named.
  two = {(lr, n): v for (lr, n), v in scores.items() if n < 1000}
  assert recipe_report.at_edge(searched({**two, (1e-3, 300): 0.9})) == []


def test_the_report_tabulates_the_grid_and_the_spread():
  points = [{'learning_rate': lr, 'steps': s, 'mean_val': v}
            for lr, s, v in [(1e-4, 100, 0.5), (1e-4, 300, 0.625), (1e-3, 100, 0.75)]]
  search = {'talos': {'points': points, 'chosen': points[2]}}
  numbers = ('finetuned', 'addition', 'addition_normalized', 'negation_target',
             'negation_control')
  spread = {'talos': {'seeds': [0, 1, 2],
                      'mean': {**dict.fromkeys(numbers, 0.5), 'xi': 0.25},
                      'std': {**dict.fromkeys(numbers, 0.012), 'xi': 0.0131},
                      'per_task': {'pretrained': {'size': 0.25, 'colour': 0.5},
                                   'finetuned': {'size': 1.0, 'colour': 0.875},
                                   'addition': {'size': 0.75, 'colour': 0.625},
                                   'negation_target': {'size': 0.125, 'colour': 0.0625}}}}
  lines = recipe_report.markdown(search, spread).splitlines()
  assert lines.count('| regime | size | colour |') == 2
  assert lines.count('| pretrained | 25.0 | 50.0 |') == 2
  assert '| talos | 100.0 → 75.0 | 87.5 → 62.5 |' in lines
  assert '| talos | 12.5 | 6.2 |' in lines
  assert '| regime | lr | 100 steps | 300 steps |' in lines
  assert '| talos | 0.0001 | 50.0 | 62.5 |' in lines
  assert '| talos | 0.001 | **75.0** |  |' in lines
  assert ('| talos | 0.001 | 100 | 3 | 50.0 ± 1.2 | 50.0 ± 1.2 | 50.0 ± 1.2 | 50.0 ± 1.2 | '
          '50.0 ± 1.2 | 0.250 ± 0.013 |') in lines


def test_the_search_chooses_on_validation_places_the_choice_and_resumes(tmp_path, monkeypatch):
  config, workdir = tiny_search(), str(tmp_path)
  result = recipe_search.run(config, workdir)
  points = result['search']['full']['points']
  assert [(p['learning_rate'], p['steps']) for p in points] == [(1e-4, 6), (3e-3, 6)]
  for p in points:
    assert p['mean_val'] == pytest.approx(sum(p['val'].values()) / 2)
  best = max(p['mean_val'] for p in points)
  expected = min((p for p in points if p['mean_val'] == best),
                 key=lambda p: (p['steps'], p['learning_rate']))
  chosen = result['search']['full']['chosen']
  assert chosen == expected == result['search']['full']['choices']['single_task']
  # Task addition's validation score of each point, by the evaluation protocol's own curve.
  exp = experiment.Experiment.load(config, workdir)
  evaluator = exp.evaluator('full')
  for p in points:
    vectors = [checkpoint.load_task_vector(os.path.join(
        workdir, 'recipe_search', 'full', f'lr{p["learning_rate"]:g}_steps6', t,
        workdir_lib.TASK_VECTOR))[0] for t in ('colour', 'size')]
    curve = evaluate.task_addition(
        evaluator, exp.theta0, vectors[0] + vectors[1], heads=exp.heads(),
        val={t: exp.task(t).val for t in exp.tasks}, test={t: exp.task(t).test for t in exp.tasks},
        finetuned={t: {'val': p['val'][t], 'test': 1.0} for t in exp.tasks},
        alphas=evaluate.alpha_grid(config.eval.alpha_step))['curve']
    best = max(curve, key=lambda c: c['normalized_val'])
    assert p['addition_val'] == pytest.approx(best['normalized_val'])
  assert result['search']['full']['choices']['addition'] == max(
      points, key=lambda p: (p['addition_val'], -p['steps'], -p['learning_rate']))
  for task in ('colour', 'size'):
    placed = workdir_lib.task_vector_file(workdir, 'full', task)
    source = os.path.join(workdir, 'recipe_search', 'full',
                          f'lr{chosen["learning_rate"]:g}_steps6', task, workdir_lib.TASK_VECTOR)
    with open(placed, 'rb') as a, open(source, 'rb') as b:
      assert a.read() == b.read()
  assert result['evaluation']['regimes']['full']['finetuned']['colour']['val'] == pytest.approx(
      chosen['val']['colour'])

  # Seed 1 fine-tunes every task again at the chosen recipe, in its own workdir's evaluation.
  seeded = os.path.join(workdir, 'recipe_search', 'seed1')
  for task in ('colour', 'size'):
    with open(workdir_lib.task_vector_file(workdir, 'full', task), 'rb') as a, \
        open(workdir_lib.task_vector_file(seeded, 'full', task), 'rb') as b:
      assert a.read() != b.read()
    with open(os.path.join(workdir_lib.finetune_dir(seeded, 'full', task),
                           workdir_lib.JOB_CONFIG)) as f:
      made = json.load(f)['finetune']
    assert (made['seed'], made['learning_rate'], made['steps']) == (
        1, chosen['learning_rate'], 6)
  with open(os.path.join(seeded, 'results.json')) as f:
    evaluations = [result['evaluation'], json.load(f)]
  spread = result['seeds']['full']
  assert spread['seeds'] == [0, 1]
  for number, of in (
      ('finetuned', lambda r: np.mean([r['finetuned'][t]['test'] for t in ('colour', 'size')])),
      ('addition_normalized', lambda r: r['addition']['mean_normalized_test']),
      ('negation_target', lambda r: np.mean([r['negation'][t]['target_test']
                                             for t in ('colour', 'size')])),
      ('xi', lambda r: np.mean(r['disentanglement']['xi']['colour:size']))):
    values = [of(e['regimes']['full']) for e in evaluations]
    assert spread['per_seed'][number] == pytest.approx(values)
    assert spread['mean'][number] == pytest.approx(np.mean(values))
    assert spread['std'][number] == pytest.approx(np.std(values, ddof=1))
  for task in ('colour', 'size'):
    for number, of in (('finetuned', lambda r: r['finetuned'][task]['test']),
                       ('addition', lambda r: r['addition']['test'][task]),
                       ('negation_target', lambda r: r['negation'][task]['target_test'])):
      assert spread['per_task'][number][task] == pytest.approx(
          np.mean([of(e['regimes']['full']) for e in evaluations]))

  def no_training(*args, **kwargs):
    raise AssertionError('a finished point was fine-tuned again')

  monkeypatch.setattr(train, 'train', no_training)
  assert recipe_search.run(config, workdir)['search'] == result['search']
  monkeypatch.undo()

  # A later run of another regime in the same workdir: the records, the spread and its plot
  # cover both regimes, the first one's unchanged. Of two more records, lora's search was cut
  # short (it is left out) and l_lora's finished but was never evaluated (it is kept in the
  # search, and out of the spread).
  root = os.path.join(workdir, 'recipe_search')
  with open(os.path.join(root, 'results.json')) as f:
    records = json.load(f)
  records['lora'] = {**searched({(1e-3, 6): 0.5}), 'complete': False}
  records['l_lora'] = searched({(1e-3, 6): 0.5})
  with open(os.path.join(root, 'results.json'), 'w') as f:
    json.dump(records, f)
  other = tiny_search()
  other.regimes = 'attention_only'
  other.sweep.finetune.learning_rate = (3e-3,)
  other.recipe_search.records = os.path.join(workdir, 'records')
  both = recipe_search.run(other, workdir)
  assert list(both['search']) == ['full', 'attention_only', 'l_lora']  # the regimes' order
  assert list(both['seeds']) == ['full', 'attention_only']
  assert both['search']['full'] == result['search']['full']
  assert both['seeds']['full'] == spread
  with open(os.path.join(root, 'results.json')) as f:
    assert json.load(f) == both['search']
  with open(os.path.join(root, 'seeds.json')) as f:
    assert json.load(f) == both['seeds']
  with open(os.path.join(root, 'report.md')) as f:
    text = f.read()
  for regime, searched_regime in both['search'].items():
    chosen = searched_regime['chosen']
    assert f'| {regime} | {chosen["learning_rate"]:g} | **{100 * chosen["mean_val"]:.1f}** |' \
        in text
  with open(os.path.join(root, 'seeds.png'), 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'

  # Its records, restored into a fresh workdir, put back every tabulated regime's search and
  # its evaluation at every seed, where a later run there reads them.
  fresh = os.path.join(workdir, 'fresh')
  restored = recipe_records.restore_records(fresh, other.recipe_search.records, 0)
  assert sorted(restored) == ['attention_only', 'full']
  with open(os.path.join(fresh, 'recipe_search', 'results.json')) as f:
    assert json.load(f) == {r: both['search'][r] for r in restored}
  for regime in restored:
    for seed_dir in ('', os.path.join('recipe_search', 'seed1')):
      evaluation = os.path.join(seed_dir, 'evaluation', regime, 'results.json')
      with open(os.path.join(workdir, evaluation)) as a, open(os.path.join(fresh, evaluation)) as b:
        assert json.load(a) == json.load(b)
  # A workdir's own finished searches are never replaced by records.
  assert recipe_records.restore_records(workdir, other.recipe_search.records, 0) == []

  # A regime searched with other fine-tuning settings would sit in the tables beside full's.
  other.regimes, other.finetune.batch_size = 'talos', 16
  with pytest.raises(UserError, match=r'the recipe an earlier run chose for \w+, was '
                     r'fine-tuned with other config.finetune settings \(batch_size\)'):
    recipe_search.run(other, workdir)


def test_a_sparse_regime_fits_each_task_s_mask_once_for_every_point(tmp_path, monkeypatch):
  config, workdir = tiny_search(), str(tmp_path)
  config.regimes = 'talos'
  config.sweep.finetune.update(learning_rate=(1e-3, 3e-3), seed=(0,))
  fitted = []

  def counted(*args, **kwargs):
    fitted.append(args)
    return calibrate(*args, **kwargs)

  calibrate = talos.calibrate
  monkeypatch.setattr(talos, 'calibrate', counted)
  recipe_search.run(config, workdir)
  assert len(fitted) == 2
  for task in ('colour', 'size'):
    masks = []
    for rate in (1e-3, 3e-3):
      directory = os.path.join(workdir, 'recipe_search', 'talos', f'lr{rate:g}_steps6', task)
      with open(os.path.join(directory, workdir_lib.UPDATE_MASK), 'rb') as f:
        masks.append(f.read())
    assert masks[0] == masks[1]


def test_a_widened_grid_s_new_choice_replaces_the_placed_one(tmp_path, monkeypatch):
  config, workdir = tiny_search(), str(tmp_path)
  config.suite.tasks, config.eval.disentanglement_pairs = 'colour', ''
  config.sweep.finetune.update(learning_rate=(1e-3,), seed=(0,))
  recipe_search.run(config, workdir)
  # The choice on validation is the test above's; here the newest point is made to win.
  monkeypatch.setattr(recipe_search, 'choose', lambda scored, by='single_task': scored[-1])
  config.sweep.finetune.learning_rate = (1e-3, 3e-3)
  result = recipe_search.run(config, workdir)
  assert result['search']['full']['chosen']['learning_rate'] == 3e-3
  source = os.path.join(workdir, 'recipe_search', 'full', 'lr0.003_steps6', 'colour')
  with open(workdir_lib.task_vector_file(workdir, 'full', 'colour'), 'rb') as placed, \
      open(os.path.join(source, workdir_lib.TASK_VECTOR), 'rb') as chosen:
    assert placed.read() == chosen.read()
  assert result['evaluation']['regimes']['full']['finetuned']['colour']['val'] == pytest.approx(
      result['search']['full']['chosen']['val']['colour'])


def test_a_workdir_holding_other_fine_tunes_is_refused(tmp_path):
  config, workdir = tiny_search(), str(tmp_path)
  config.sweep.finetune.learning_rate = (3e-3,)
  os.makedirs(workdir_lib.finetune_dir(workdir, 'full', 'colour'))
  with open(os.path.join(workdir_lib.finetune_dir(workdir, 'full', 'colour'),
                         workdir_lib.JOB_CONFIG), 'w') as f:
    f.write('{"finetune": {"learning_rate": 0.1}}')
  with pytest.raises(UserError, match='other settings than any point'):
    recipe_search.run(config, workdir)
  assert not os.path.exists(os.path.join(workdir, 'recipe_search'))


@pytest.mark.parametrize('change, message', [
    (dict(seed=()), r'^config.sweep.finetune.seed is an empty grid'),
    (dict(seed=(0, 0)), r'^config.sweep.finetune.seed = \(0, 0\) lists 0 twice$'),
    (dict(seed=(1, -1)), r'^config.sweep.finetune.seed = -1: must be an integer in \[0, inf\)$'),
    (dict(learning_rate=(1e-3, 1e-3)),
     r'^config.sweep.finetune.learning_rate = \(0.001, 0.001\) lists 0.001 twice$'),
])
def test_a_bad_grid_is_named_before_any_work(tmp_path, change, message):
  config = tiny_search()
  config.sweep.finetune.update(change)
  with pytest.raises(UserError, match=message):
    recipe_search.run(config, str(tmp_path))
  assert not os.listdir(tmp_path)


def test_a_setting_given_a_value_and_an_axis_is_refused_and_a_value_alone_is_one_point():
  config = tiny_search()
  config.finetune.steps = 6
  with pytest.raises(UserError) as raised:
    recipe_search.points(config)
  assert str(raised.value) == ('config.finetune.steps = 6 and config.sweep.finetune.steps = '
                               '(6,) both set it; give one')
  config.sweep.finetune.steps = None
  assert recipe_search.points(config) == [(1e-4, 6), (3e-3, 6)]
  config.sweep.finetune.update(learning_rate=None, seed=None)
  config.finetune.update(learning_rate=1e-3, seed=0)
  with pytest.raises(UserError, match=r'^config.sweep.finetune: the recipe search needs an axis'):
    recipe_search.points(config)


def test_records_are_refused_when_evaluated_otherwise_or_malformed(tmp_path):
  records = tmp_path / 'records'
  records.mkdir()
  evaluation = tmp_path / 'other' / 'evaluation'
  evaluation.mkdir(parents=True)
  (evaluation / workdir_lib.JOB_CONFIG).write_text('{"base": "another backbone"}')
  (records / 'full.json').write_text(json.dumps(
      {'search': searched({(1e-3, 6): 0.5}), 'evaluations': {'0': {}},
       'settings': {'base': 'the shipped backbone'}}))
  with pytest.raises(UserError, match=r'full.json was evaluated with other settings than .*'
                     r'other/evaluation'):
    recipe_records.restore_records(str(tmp_path / 'other'), str(records), 0)
  assert os.listdir(tmp_path / 'other') == ['evaluation']
  (records / 'full.json').write_text('{"search": {}}')
  with pytest.raises(UserError, match=r'full.json is not a recipe search record'):
    recipe_records.restore_records(str(tmp_path / 'fresh'), str(records), 0)
  with pytest.raises(UserError, match=r'recipe_search/seeds.json is missing'):
    recipe_records.save_records(str(tmp_path / 'fresh'), str(records), 0)
