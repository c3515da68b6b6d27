"""The recipe search: every point fine-tuned and scored on validation, the best chosen per
regime and placed where the evaluation reads it, resumable."""

import os

import pytest

from configs import quickstart
from editing import train
from editing.errors import UserError
from editing.jobs import recipe_search
from editing.jobs import workdir as workdir_lib


def tiny_search():
  config = quickstart.get_config('tiny')
  config.suite.tasks = 'colour,size'
  config.eval.disentanglement_pairs = 'colour:size'
  config.recipe_search.update(learning_rate=(1e-4, 3e-3), steps=(6,))
  return config


def test_ties_go_to_fewer_steps_then_the_smaller_rate():
  points = [{'learning_rate': lr, 'steps': s, 'mean_val': v}
            for lr, s, v in [(1e-3, 300, 0.9), (1e-3, 100, 0.9), (1e-4, 100, 0.9),
                             (3e-4, 100, 0.8)]]
  assert recipe_search.choose(points) == points[2]
  points.append({'learning_rate': 1e-2, 'steps': 300, 'mean_val': 0.95})
  assert recipe_search.choose(points) == points[-1]


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
  assert chosen == expected
  for task in ('colour', 'size'):
    placed = workdir_lib.task_vector_file(workdir, 'full', task)
    source = os.path.join(workdir, 'recipe_search', 'full',
                          f'lr{chosen["learning_rate"]:g}_steps6', task, workdir_lib.TASK_VECTOR)
    with open(placed, 'rb') as a, open(source, 'rb') as b:
      assert a.read() == b.read()
  assert result['evaluation']['regimes']['full']['finetuned']['colour']['val'] == pytest.approx(
      chosen['val']['colour'])

  def no_training(*args, **kwargs):
    raise AssertionError('a finished point was fine-tuned again')

  monkeypatch.setattr(train, 'train', no_training)
  assert recipe_search.run(config, workdir)['search'] == result['search']


def test_a_workdir_holding_other_fine_tunes_is_refused(tmp_path):
  config, workdir = tiny_search(), str(tmp_path)
  config.recipe_search.update(learning_rate=(3e-3,))
  os.makedirs(workdir_lib.finetune_dir(workdir, 'full', 'colour'))
  with open(os.path.join(workdir_lib.finetune_dir(workdir, 'full', 'colour'),
                         workdir_lib.JOB_CONFIG), 'w') as f:
    f.write('{"finetune": {"learning_rate": 0.1}}')
  with pytest.raises(UserError, match='other settings than any point'):
    recipe_search.run(config, workdir)
  assert not os.path.exists(os.path.join(workdir, 'recipe_search'))
