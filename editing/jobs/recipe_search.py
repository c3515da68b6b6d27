"""Each regime's own fine-tuning recipe, chosen on validation; then the protocols at it.

The search is a sweep (`editing.sweep`) over config.finetune, written apart from its values:
every regime of `config.regimes` is fine-tuned on every task at each point of the grid
config.sweep.finetune.learning_rate × config.sweep.finetune.steps (the rest of config.finetune
unchanged; a setting with no axis keeps its one value, and one given both a value and an axis
is refused), into <workdir>/recipe_search/<regime>/lr<rate>_steps<n>/<task>/. A point is scored
by the mean over tasks of each single-task model's validation accuracy, the criterion the papers
fine-tune by; the best point is the regime's recipe (ties go to fewer steps, then the smaller
rate). No test split is read before the choice. configs/recipe_search.py gives the grid.

The search runs at the first fine-tuning seed of config.sweep.finetune.seed. The chosen vectors
are then put at <workdir>/finetune/<regime>/<task>/, where every job looks for them, and
`editing.jobs.evaluate` runs addition, negation and ξ on them. Each other seed fine-tunes every
task again at the regime's chosen recipe with that `finetune.seed` (data order, and the
initialisation of anything random) and is evaluated in <workdir>/recipe_search/seed<s>/;
<workdir>/recipe_search/seeds.json holds each regime's numbers per seed, and their mean and
standard deviation, seeds.png their spread, and report.md the search and the regimes at their
recipes as markdown tables (`editing.jobs.recipe_report`).

The search is resumable: each finished fine-tune is reused, and
<workdir>/recipe_search/results.json is rewritten after every point. One workdir gathers
regimes searched by separate runs (`--config.regimes=talos`, later `--config.regimes=lora`):
results.json, seeds.json, seeds.png, report.md and the printed tables cover every regime it
holds. A choice on the grid's edge (named in the log and the table) can be followed by a wider
grid in the same workdir: the finished points are reused, and a new choice replaces the old.
Regimes searched in separate workdirs, on other machines or days, gather through
`config.recipe_search.records`: a directory of each regime's search and evaluations at every
seed (<regime>.json, `editing.jobs.recipe_records`), restored into the workdir before a run
and saved after it.
"""

import json
import os
import shutil

import ml_collections
import numpy as np
from absl import logging

from editing import atomic
from editing import evaluate as evaluate_lib
from editing import regimes
from editing import sweep
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import evaluate
from editing.jobs import experiment
from editing.jobs import finetune
from editing.jobs import pretrain
from editing.jobs import quickstart
from editing.jobs import recipe_records
from editing.jobs import recipe_report
from editing.jobs import workdir as workdir_lib

LEARNING_RATE, STEPS, SEED = 'finetune.learning_rate', 'finetune.steps', 'finetune.seed'
# config.recipe_search.select: the criterion that chooses a regime's recipe, by the point's key.
SELECT = {'single_task': 'mean_val', 'addition': 'addition_val'}


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Searches every configured regime's recipe, then evaluates each regime at its own, for
  every seed.

  Returns {'search': {regime: {'points': [...], 'chosen': point, 'complete': True}},
  'evaluation': the evaluation's results of this run's regimes at the search's seed (also
  <workdir>/results.json and report.md), 'seeds': `recipe_report.over_seeds` of every
  regime's at every seed}.
  """
  checks.validate(config, quickstart.SECTIONS)
  if config.recipe_search.get('select', 'single_task') not in SELECT:
    raise UserError(f'config.recipe_search.select = {config.recipe_search.select!r}; choose '
                    f'one of {sorted(SELECT)}')
  grid, seeds = points(config), seed_list(config)
  config = sweep.overridden(config, {SEED: seeds[0]})  # the search's own seed
  root = os.path.join(workdir, 'recipe_search')
  records = config.recipe_search.records
  if records and os.path.isdir(records):
    restored = recipe_records.restore_records(workdir, records, seeds[0])
    logging.info('recipe search: %s restored from %s', ', '.join(restored) or 'nothing', records)
  search = _recorded(os.path.join(root, 'results.json'))
  _check_targets(config, workdir, grid, list(search))
  pretrain.run(config, workdir)
  exp = experiment.Experiment.load(config, workdir)
  for regime in experiment.configured_regimes(config):
    chosen = _search(config, workdir, exp, regime, grid, search)
    for task in exp.tasks:
      _place(_point_dir(root, regime.name, chosen['learning_rate'], chosen['steps'], task),
             workdir_lib.finetune_dir(workdir, regime.name, task))
  search = {name: search[name] for name in regimes.REGISTRY if name in search}
  print(recipe_report.table(search))
  evaluation = evaluate.run(config, workdir)
  for seed in seeds[1:]:
    _seed_run(config, workdir, exp.tasks, search, seed)
  by_seed = recipe_records.evaluations(workdir, list(search), seeds, seeds[0])
  spread = recipe_report.over_seeds(by_seed)
  atomic.write_json(os.path.join(root, 'seeds.json'), spread)
  recipe_report.plot_spread(by_seed, os.path.join(root, 'seeds.png'))
  atomic.write_bytes(os.path.join(root, 'report.md'),
                     recipe_report.markdown(search, spread).encode())
  print(recipe_report.seed_table(search, spread))
  if records:
    logging.info('recipe search: %s saved to %s',
                 ', '.join(recipe_records.save_records(workdir, records, seeds[0])), records)
  return {'search': search, 'evaluation': evaluation, 'seeds': spread}


def _search(config: ml_collections.ConfigDict, workdir: str, exp: experiment.Experiment,
            regime: regimes.Regime, grid: list[tuple[float, int]], search: dict) -> dict:
  """Fine-tunes every task at every point of `grid` and scores each point on validation,
  recording the points in `search` (and results.json) as they finish; returns the chosen one."""
  root = os.path.join(workdir, 'recipe_search')
  evaluator, scored = exp.evaluator(regime.name), []
  for learning_rate, steps in grid:
    point = sweep.overridden(config, {LEARNING_RATE: learning_rate, STEPS: steps})
    val, vectors = {}, []
    for task in exp.tasks:
      logging.info('recipe search, %s: lr %g, %d steps, %s', regime.name, learning_rate, steps,
                   task)
      directory = _point_dir(root, regime.name, learning_rate, steps, task)
      _reuse_mask(_point_dir(root, regime.name, *grid[0], task), directory)
      vector = finetune.run(point, workdir, task, regime, directory=directory)
      vectors.append(vector)
      val[task] = evaluator.accuracy(exp.theta0, evaluator.edit(exp.theta0, vector, 1.0),
                                     exp.head(task), exp.task(task).val)
    addition_val, alpha = _addition_val(config, exp, evaluator, vectors, val)
    scored.append({'learning_rate': learning_rate, 'steps': steps, 'val': val,
                   'mean_val': float(np.mean(list(val.values()))),
                   'addition_val': addition_val, 'addition_alpha': alpha})
    choices = {by: choose(scored, by) for by in SELECT}
    search[regime.name] = {'points': scored, 'chosen': choices[config.recipe_search.select],
                           'choices': choices, 'complete': len(scored) == len(grid)}
    atomic.write_json(os.path.join(root, 'results.json'), search)
  chosen = search[regime.name]['chosen']
  logging.info('recipe search, %s: lr %g and %d steps (mean validation accuracy %.3f)',
               regime.name, chosen['learning_rate'], chosen['steps'], chosen['mean_val'])
  edges = recipe_report.at_edge(search[regime.name])
  if edges:
    logging.warning('recipe search, %s: the chosen %s on the grid\'s edge; a wider grid might '
                    'choose past it', regime.name, ' and '.join(edges))
  return chosen


def _reuse_mask(source: str, directory: str) -> None:
  """The update mask fitted in `source`, if any, copied to `directory` before it fine-tunes.

  A sparse regime's mask depends on θ0, the task, the regime's settings and the seed, which
  every point of the grid shares, and not on the learning rate or steps: each task's is fitted
  once, at the first point (for TaLoS, R rounds of scoring, about the time of 100 steps).
  """
  mask = os.path.join(source, workdir_lib.UPDATE_MASK)
  target = os.path.join(directory, workdir_lib.UPDATE_MASK)
  if source != directory and os.path.exists(mask) and not os.path.exists(target):
    with open(mask, 'rb') as f:
      atomic.write_bytes(target, f.read())


def _recorded(path: str) -> dict:
  """The finished searches an earlier run of this workdir recorded (one cut short is left
  out: this run's tables do not show a part of a grid as the whole)."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return {name: r for name, r in json.load(f).items() if r.get('complete')}


def _seed_run(config: ml_collections.ConfigDict, workdir: str, tasks: list[str], search: dict,
              seed: int) -> None:
  """Every regime fine-tuned again at its chosen recipe with finetune.seed = `seed`, and
  evaluated in a workdir of the seed's own (the same backbone and suite)."""
  seeded = sweep.overridden(config, {SEED: seed})
  root = os.path.join(workdir, 'recipe_search')
  seed_workdir = recipe_records.seed_workdir(workdir, seed, config.finetune.seed)
  _share_backbone(workdir, seed_workdir)
  for regime in experiment.configured_regimes(config):
    chosen = search[regime.name]['chosen']
    point = sweep.overridden(seeded, {LEARNING_RATE: chosen['learning_rate'],
                                      STEPS: chosen['steps']})
    for task in tasks:
      logging.info('recipe search, %s at its recipe: seed %d, %s', regime.name, seed, task)
      directory = _point_dir(root, regime.name, chosen['learning_rate'], chosen['steps'], task,
                             seed)
      finetune.run(point, workdir, task, regime, directory=directory)
      _place(directory, workdir_lib.finetune_dir(seed_workdir, regime.name, task))
  evaluate.run(seeded, seed_workdir)


def _share_backbone(workdir: str, seed_workdir: str) -> None:
  """θ0, its record and its fitted heads copied from the search's workdir, once: every seed
  edits the same backbone, which is not pretrained again."""
  if os.path.exists(workdir_lib.pretrained_file(seed_workdir)):
    return
  source = workdir_lib.pretrain_dir(workdir)
  with atomic.directory(workdir_lib.pretrain_dir(seed_workdir)) as tmp:
    for name in (os.path.basename(workdir_lib.pretrained_file(workdir)), workdir_lib.JOB_CONFIG):
      shutil.copy2(os.path.join(source, name), os.path.join(tmp, name))
    heads = os.path.dirname(workdir_lib.head_file(workdir, 'any'))
    if os.path.isdir(heads):
      shutil.copytree(heads, os.path.join(tmp, os.path.basename(heads)))


def points(config: ml_collections.ConfigDict) -> list[tuple[float, int]]:
  """The (learning rate, steps) grid: every combination of the axes
  config.sweep.finetune.learning_rate and .steps (`editing.sweep`)."""
  axes = _axes(config)
  return [(float(p[LEARNING_RATE]), int(p[STEPS]))
          for p in sweep.points({k: axes[k] for k in (LEARNING_RATE, STEPS)})]


def seed_list(config: ml_collections.ConfigDict) -> list[int]:
  """The fine-tuning seeds of config.sweep.finetune.seed: the search runs at the first, and
  every regime's recipe is evaluated at each."""
  return list(_axes(config)[SEED])


def _axes(config: ml_collections.ConfigDict) -> dict[str, tuple]:
  """The axes of config.sweep.finetune over the learning rate, steps and seed; a setting with
  no axis is an axis of its one value in config.finetune. A setting given both, or neither,
  is refused, as is a search with no axis of the learning rate or steps."""
  axes = sweep.axes(config, 'finetune')
  unknown = sorted(set(axes) - {LEARNING_RATE, STEPS, SEED})
  if unknown:
    raise UserError(f'config.sweep.{unknown[0]}: the recipe search sweeps the learning_rate, '
                    'steps and seed of config.finetune, no other setting')
  sweep.refuse_value_and_axis(config, axes)
  if not {LEARNING_RATE, STEPS} & set(axes):
    raise UserError('config.sweep.finetune: the recipe search needs an axis of learning_rate '
                    'or steps (configs/recipe_search.py gives both)')
  for key in (LEARNING_RATE, STEPS, SEED):
    if key not in axes:
      value = sweep.value_at(config, key)
      if value is None:
        raise UserError(f'config.{key} and config.sweep.{key} are both unset; give one')
      axes[key] = (value,)
  return axes


def choose(scored: list[dict], by: str = 'single_task') -> dict:
  """The point of best mean single-task validation accuracy, or (by 'addition') of best
  normalized validation accuracy of task addition; ties go to fewer steps, then the smaller
  learning rate."""
  key = SELECT[by]
  # A point whose addition is not scored (a task it did not learn) is chosen by addition last.
  return max(scored, key=lambda p: (-np.inf if p[key] is None else p[key], -p['steps'],
                                    -p['learning_rate']))


def _addition_val(config: ml_collections.ConfigDict, exp: experiment.Experiment, evaluator,
                  vectors: list, single: dict) -> tuple[float | None, float | None]:
  """(the best over α of the mean over tasks of θ0 + α·Σ τ_t's validation accuracy, each
  normalized by the task's single-task validation accuracy `single`; that α), on
  config.eval's α grid (`editing.evaluate.addition_curve`); (None, None) where a task's
  single-task accuracy is 0, which leaves the normalization undefined."""
  if not all(single.values()):
    return None, None
  curve = evaluate_lib.addition_curve(
      evaluator, exp.theta0, sum(vectors[1:], vectors[0]),
      heads={t: exp.head(t) for t in exp.tasks}, val={t: exp.task(t).val for t in exp.tasks},
      finetuned_val=single, alphas=evaluate_lib.alpha_grid(config.eval.alpha_step))
  best = max(curve, key=lambda point: point['normalized_val'])
  return best['normalized_val'], best['alpha']


def _check_targets(config: ml_collections.ConfigDict, workdir: str,
                   grid: list[tuple[float, int]], recorded: list[str]) -> None:
  """Refuses, before any work, a workdir whose fine-tunes were made otherwise than this run
  would make them: a configured regime's must be of a point of the grid (their place is where
  the chosen vectors go), and those of a regime an earlier run searched, which this run's
  tables show beside its own, must share every fine-tuning setting but the learning rate and
  steps."""
  configured = [r.name for r in experiment.configured_regimes(config)]
  for regime in configured + [r for r in recorded if r not in configured]:
    for task in experiment.tasks(config):
      record = os.path.join(workdir_lib.finetune_dir(workdir, regime, task),
                            workdir_lib.JOB_CONFIG)
      if not os.path.exists(record):
        continue
      with open(record) as f:
        made = json.load(f).get('finetune', {})
      recipe = made.get('learning_rate'), made.get('steps')
      ours = {**experiment.training_record(config.finetune),
              'learning_rate': recipe[0], 'steps': recipe[1]}
      if regime in configured and (made != ours or recipe not in grid):
        raise UserError(f'{os.path.dirname(record)} holds a fine-tune of other settings than '
                        'any point of config.recipe_search; use another --workdir for the '
                        'recipe search')
      if made != ours:
        differing = sorted(k for k in ours.keys() | made.keys() if ours.get(k) != made.get(k))
        raise UserError(f'{os.path.dirname(record)}, the recipe an earlier run chose for '
                        f'{regime}, was fine-tuned with other config.finetune settings '
                        f'({", ".join(differing)}); use another --workdir, or the same '
                        'settings')


def _point_dir(root: str, regime: str, learning_rate: float, steps: int, task: str,
               seed: int | None = None) -> str:
  """A point's fine-tune of `task`; with `seed`, its fine-tune at that other seed."""
  point = f'lr{learning_rate:g}_steps{steps}' + ('' if seed is None else f'_seed{seed}')
  return os.path.join(root, regime, point, task)


def _place(source: str, target: str) -> None:
  """The chosen fine-tune's results (its vector, mask and record, not its training state) at
  `target`, in place of another point's that an earlier search chose there (a search widened
  past its grid's edge may choose anew; `_check_targets` has refused any fine-tune that is not
  a point of the grid)."""
  files = [f for f in (workdir_lib.TASK_VECTOR, workdir_lib.UPDATE_MASK, workdir_lib.JOB_CONFIG)
           if os.path.exists(os.path.join(source, f))]
  record = os.path.join(target, workdir_lib.JOB_CONFIG)
  if os.path.exists(record):
    with open(record) as mine, open(os.path.join(source, workdir_lib.JOB_CONFIG)) as chosen:
      same = mine.read() == chosen.read()
    if same and os.path.exists(os.path.join(target, workdir_lib.TASK_VECTOR)):
      return
    if not same:
      logging.info('recipe search: the fine-tune chosen now replaces the one at %s', target)
  with atomic.directory(target) as tmp:
    for f in files:
      shutil.copy2(os.path.join(source, f), os.path.join(tmp, f))
