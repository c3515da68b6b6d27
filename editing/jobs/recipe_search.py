"""Each regime's own fine-tuning recipe, chosen on validation; then the protocols at it.

Every regime of `config.regimes` is fine-tuned on every task at each point of the grid
`config.recipe_search.learning_rate` × `config.recipe_search.steps` (the rest of
`config.finetune` unchanged), into <workdir>/recipe_search/<regime>/lr<rate>_steps<n>/<task>/.
A point is scored by the mean over tasks of each single-task model's validation accuracy, the
criterion the papers fine-tune by; the best point is the regime's recipe (ties go to fewer
steps, then the smaller rate). No test split is read before the choice.

The chosen vectors are then put at <workdir>/finetune/<regime>/<task>/, where every job looks
for them, and `editing.jobs.evaluate` runs addition, negation and ξ on them. The search is
resumable: each finished fine-tune is reused, and <workdir>/recipe_search/results.json is
rewritten after every point.
"""

import json
import os
import shutil

import ml_collections
import numpy as np
from absl import logging

from editing import atomic
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import evaluate
from editing.jobs import experiment
from editing.jobs import finetune
from editing.jobs import pretrain
from editing.jobs import workdir as workdir_lib


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Searches every configured regime's recipe, then evaluates each regime at its own.

  Returns {'search': {regime: {'points': [...], 'chosen': point}}, 'evaluation': the
  evaluation's results}.
  """
  checks.validate(config)
  grid = points(config)
  _check_targets(config, workdir, grid)
  pretrain.run(config, workdir)
  exp = experiment.Experiment.load(config, workdir)
  root = os.path.join(workdir, 'recipe_search')
  search = {}
  for regime in experiment.configured_regimes(config):
    evaluator, scored = exp.evaluator(regime.name), []
    for learning_rate, steps in grid:
      point = ml_collections.ConfigDict(config.to_dict())
      point.finetune.update(learning_rate=learning_rate, steps=steps)
      val = {}
      for task in exp.tasks:
        logging.info('recipe search, %s: lr %g, %d steps, %s', regime.name, learning_rate,
                     steps, task)
        vector = finetune.run(point, workdir, task, regime,
                              directory=_point_dir(root, regime.name, learning_rate, steps, task))
        val[task] = evaluator.accuracy(exp.theta0, evaluator.edit(exp.theta0, vector, 1.0),
                                       exp.head(task), exp.task(task).val)
      scored.append({'learning_rate': learning_rate, 'steps': steps, 'val': val,
                     'mean_val': float(np.mean(list(val.values())))})
      search[regime.name] = {'points': scored, 'chosen': choose(scored)}
      atomic.write_json(os.path.join(root, 'results.json'), search)
    chosen = search[regime.name]['chosen']
    logging.info('recipe search, %s: lr %g and %d steps (mean validation accuracy %.3f)',
                 regime.name, chosen['learning_rate'], chosen['steps'], chosen['mean_val'])
    for task in exp.tasks:
      _place(_point_dir(root, regime.name, chosen['learning_rate'], chosen['steps'], task),
             workdir_lib.finetune_dir(workdir, regime.name, task))
  print(table(search))
  return {'search': search, 'evaluation': evaluate.run(config, workdir)}


def points(config: ml_collections.ConfigDict) -> list[tuple[float, int]]:
  """The (learning rate, steps) grid of `config.recipe_search`."""
  section = config.recipe_search
  grid = [(float(lr), int(steps)) for lr in section.learning_rate for steps in section.steps]
  if not grid or len(set(grid)) != len(grid):
    raise UserError('config.recipe_search: learning_rate and steps must each list at least one '
                    f'value, none twice (got {tuple(section.learning_rate)} and '
                    f'{tuple(section.steps)})')
  return grid


def choose(scored: list[dict]) -> dict:
  """The point of best mean validation accuracy; ties go to fewer steps, then the smaller
  learning rate."""
  return max(scored, key=lambda p: (p['mean_val'], -p['steps'], -p['learning_rate']))


def table(search: dict) -> str:
  """Every point's mean validation accuracy per regime, the chosen one marked."""
  lines = [f'{"regime":>15} {"lr":>8} {"steps":>6} {"mean val":>9}']
  for regime, result in search.items():
    for p in result['points']:
      mark = '  <- chosen' if p == result['chosen'] else ''
      lines.append(f'{regime:>15} {p["learning_rate"]:8.0e} {p["steps"]:6d} '
                   f'{100 * p["mean_val"]:9.1f}{mark}')
  return '\n'.join(lines)


def _check_targets(config, workdir: str, grid) -> None:
  """Refuses, before any work, a workdir whose fine-tunes are of no point of the grid (their
  place is where the chosen vectors go)."""
  for regime in experiment.configured_regimes(config):
    for task in experiment.tasks(config):
      record = os.path.join(workdir_lib.finetune_dir(workdir, regime.name, task),
                            workdir_lib.JOB_CONFIG)
      if not os.path.exists(record):
        continue
      with open(record) as f:
        made = json.load(f).get('finetune', {})
      ours = {**experiment.training_record(config.finetune),
              'learning_rate': made.get('learning_rate'), 'steps': made.get('steps')}
      if made != ours or (made.get('learning_rate'), made.get('steps')) not in grid:
        raise UserError(f'{os.path.dirname(record)} holds a fine-tune of other settings than '
                        'any point of config.recipe_search; use another --workdir for the '
                        'recipe search')


def _point_dir(root: str, regime: str, learning_rate: float, steps: int, task: str) -> str:
  return os.path.join(root, regime, f'lr{learning_rate:g}_steps{steps}', task)


def _place(source: str, target: str) -> None:
  """The chosen fine-tune's results (its vector, mask and record, not its training state) at
  `target`; refused if `target` holds a fine-tune of other settings."""
  files = [f for f in (workdir_lib.TASK_VECTOR, workdir_lib.UPDATE_MASK, workdir_lib.JOB_CONFIG)
           if os.path.exists(os.path.join(source, f))]
  record = os.path.join(target, workdir_lib.JOB_CONFIG)
  if os.path.exists(record):
    with open(record) as mine, open(os.path.join(source, workdir_lib.JOB_CONFIG)) as chosen:
      if mine.read() != chosen.read():
        raise UserError(f'{target} holds a fine-tune of other settings than the chosen recipe; '
                        'use another --workdir for the recipe search')
    if os.path.exists(os.path.join(target, workdir_lib.TASK_VECTOR)):
      return
  with atomic.directory(target) as tmp:
    for f in files:
      shutil.copy2(os.path.join(source, f), os.path.join(tmp, f))
