"""Each regime's own fine-tuning recipe, chosen on validation; then the protocols at it.

Every regime of `config.regimes` is fine-tuned on every task at each point of the grid
`config.recipe_search.learning_rate` × `config.recipe_search.steps` (the rest of
`config.finetune` unchanged), into <workdir>/recipe_search/<regime>/lr<rate>_steps<n>/<task>/.
A point is scored by the mean over tasks of each single-task model's validation accuracy, the
criterion the papers fine-tune by; the best point is the regime's recipe (ties go to fewer
steps, then the smaller rate). No test split is read before the choice.

The chosen vectors are then put at <workdir>/finetune/<regime>/<task>/, where every job looks
for them, and `editing.jobs.evaluate` runs addition, negation and ξ on them. Each other seed of
`config.recipe_search.seeds` fine-tunes every task again at the regime's chosen recipe with
that `finetune.seed` (data order, and the initialisation of anything random) and is evaluated
in <workdir>/recipe_search/seed<s>/; <workdir>/recipe_search/seeds.json holds each regime's
numbers per seed, and their mean and standard deviation, seeds.png their spread, and report.md
the search and the regimes at their recipes as markdown tables.

The search is resumable: each finished fine-tune is reused, and
<workdir>/recipe_search/results.json is rewritten after every point. One workdir gathers
regimes searched by separate runs (`--config.regimes=talos`, later `--config.regimes=lora`):
results.json, seeds.json, seeds.png, report.md and the printed tables cover every regime it
holds. A choice on the grid's edge (named in the log and the table) can be followed by a wider
grid in the same workdir: the finished points are reused, and a new choice replaces the old.
Regimes searched in separate workdirs, on other machines or days, gather through
`config.recipe_search.records`: a directory of each regime's search and evaluations at every
seed (<regime>.json), restored into the workdir before a run and saved after it.
"""

import json
import os
import shutil

import ml_collections
import numpy as np
from absl import logging

from editing import atomic
from editing import regimes
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import evaluate
from editing.jobs import experiment
from editing.jobs import finetune
from editing.jobs import pretrain
from editing.jobs import report
from editing.jobs import workdir as workdir_lib


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Searches every configured regime's recipe, then evaluates each regime at its own, for
  every seed.

  Returns {'search': {regime: {'points': [...], 'chosen': point, 'complete': True}},
  'evaluation': the evaluation's results of this run's regimes at config.finetune.seed (also
  <workdir>/results.json and report.md), 'seeds': `over_seeds` of every regime's at every seed}.
  """
  checks.validate(config)
  grid = points(config)
  seeds = _seeds(config)
  root = os.path.join(workdir, 'recipe_search')
  records = config.recipe_search.records
  if records and os.path.isdir(records):
    restored = restore_records(config, workdir, records)
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
  print(table(search))
  evaluation = evaluate.run(config, workdir)
  for seed in seeds:
    if seed != config.finetune.seed:
      _seed_run(config, workdir, exp.tasks, search, seed)
  by_seed = _evaluations(config, workdir, list(search), seeds)
  spread = over_seeds(by_seed)
  atomic.write_json(os.path.join(root, 'seeds.json'), spread)
  plot_spread(by_seed, os.path.join(root, 'seeds.png'))
  atomic.write_bytes(os.path.join(root, 'report.md'), markdown(search, spread).encode())
  print(seed_table(search, spread))
  if records:
    logging.info('recipe search: %s saved to %s',
                 ', '.join(save_records(config, workdir, records)), records)
  return {'search': search, 'evaluation': evaluation, 'seeds': spread}


def _search(config: ml_collections.ConfigDict, workdir: str, exp: experiment.Experiment,
            regime: regimes.Regime, grid: list[tuple[float, int]], search: dict) -> dict:
  """Fine-tunes every task at every point of `grid` and scores each point on validation,
  recording the points in `search` (and results.json) as they finish; returns the chosen one."""
  root = os.path.join(workdir, 'recipe_search')
  evaluator, scored = exp.evaluator(regime.name), []
  for learning_rate, steps in grid:
    point = ml_collections.ConfigDict(config.to_dict())
    point.finetune.update(learning_rate=learning_rate, steps=steps)
    val = {}
    for task in exp.tasks:
      logging.info('recipe search, %s: lr %g, %d steps, %s', regime.name, learning_rate, steps,
                   task)
      directory = _point_dir(root, regime.name, learning_rate, steps, task)
      _reuse_mask(_point_dir(root, regime.name, *grid[0], task), directory)
      vector = finetune.run(point, workdir, task, regime, directory=directory)
      val[task] = evaluator.accuracy(exp.theta0, evaluator.edit(exp.theta0, vector, 1.0),
                                     exp.head(task), exp.task(task).val)
    scored.append({'learning_rate': learning_rate, 'steps': steps, 'val': val,
                   'mean_val': float(np.mean(list(val.values())))})
    search[regime.name] = {'points': scored, 'chosen': choose(scored),
                           'complete': len(scored) == len(grid)}
    atomic.write_json(os.path.join(root, 'results.json'), search)
  chosen = search[regime.name]['chosen']
  logging.info('recipe search, %s: lr %g and %d steps (mean validation accuracy %.3f)',
               regime.name, chosen['learning_rate'], chosen['steps'], chosen['mean_val'])
  edges = at_edge(search[regime.name])
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


def _seed_workdir(config: ml_collections.ConfigDict, workdir: str, seed: int) -> str:
  if seed == config.finetune.seed:
    return workdir
  return os.path.join(workdir, 'recipe_search', f'seed{seed}')


def _evaluations(config: ml_collections.ConfigDict, workdir: str, names: list[str],
                 seeds: list[int]) -> dict[int, dict]:
  """{seed: {'regimes': {regime: its evaluation}}} for every regime of `names` this workdir
  holds an evaluation of at every seed (read from each seed's
  evaluation/<regime>/results.json); the others are named in a warning."""
  found = {}
  for regime in names:
    files = [_evaluation_file(config, workdir, regime, s) for s in seeds]
    missing = [s for s, f in zip(seeds, files) if not os.path.exists(f)]
    if missing:
      logging.warning('recipe search: %s has no evaluation at seeds %s; it is left out of '
                      'seeds.json, seeds.png and report.md', regime, missing)
      continue
    for seed, file in zip(seeds, files):
      with open(file) as f:
        found.setdefault(seed, {'regimes': {}})['regimes'][regime] = json.load(f)
  return found


def save_records(config: ml_collections.ConfigDict, workdir: str, directory: str) -> list[str]:
  """Each regime this workdir searched and evaluated at every seed (those of
  recipe_search/seeds.json) as <directory>/<regime>.json: {'search': its entry of
  recipe_search/results.json, 'evaluations': {seed: evaluation/<regime>/results.json of that
  seed}, 'settings': what those evaluations depend on besides the vectors (the evaluation's
  job_config.json)}. Returns the regimes saved.

  Regimes searched in separate workdirs, on other machines or days, are gathered into one by
  `restore_records`.
  """
  root = os.path.join(workdir, 'recipe_search')
  spread = _read_json(os.path.join(root, 'seeds.json'),
                      'written once a recipe search has evaluated its regimes at every seed')
  searched = _read_json(os.path.join(root, 'results.json'), 'the recipe search\'s points')
  settings = _read_json(os.path.join(workdir_lib.evaluation_root(workdir), workdir_lib.JOB_CONFIG),
                        'the evaluation\'s settings')
  for regime, numbers in spread.items():
    evaluations = {str(s): _read_json(_evaluation_file(config, workdir, regime, s),
                                      f'the evaluation of {regime} at seed {s}')
                   for s in numbers['seeds']}
    atomic.write_json(os.path.join(directory, f'{regime}.json'),
                      {'search': searched[regime], 'evaluations': evaluations,
                       'settings': settings})
  return list(spread)


def restore_records(config: ml_collections.ConfigDict, workdir: str,
                    directory: str) -> list[str]:
  """Puts each record of `directory` (`save_records`) back into `workdir`, unless the workdir
  holds a finished search of that regime: its search into recipe_search/results.json and its
  evaluation at each seed into that seed's workdir. A later run of other regimes in `workdir`
  then tabulates and plots them beside its own. A record evaluated under other settings (suite,
  backbone, heads) than the workdir's is refused before anything is written. Returns the
  regimes restored.
  """
  results = os.path.join(workdir, 'recipe_search', 'results.json')
  searched = {}
  if os.path.exists(results):
    searched = _read_json(results, 'the recipe search\'s points')
  records = {}
  for name in sorted(n for n in os.listdir(directory) if n.endswith('.json')):
    path = os.path.join(directory, name)
    record = _read_json(path, 'a recipe search record')
    if set(record) != {'search', 'evaluations', 'settings'}:
      raise UserError(f'{path} is not a recipe search record (its keys are '
                      f'{sorted(record)}, not evaluations, search and settings)')
    regime = name.removesuffix('.json')
    if not searched.get(regime, {}).get('complete'):
      records[regime] = record
  for regime, record in records.items():
    for seed in record['evaluations']:
      evaluation_root = workdir_lib.evaluation_root(_seed_workdir(config, workdir, int(seed)))
      if _differs(evaluation_root, record['settings']):
        raise UserError(f'{os.path.join(directory, regime)}.json was evaluated with other '
                        f'settings than {evaluation_root}; restore it into another workdir')
  for regime, record in records.items():
    for seed, evaluation in record['evaluations'].items():
      seed_workdir = _seed_workdir(config, workdir, int(seed))
      workdir_lib.check_job_config(workdir_lib.evaluation_root(seed_workdir), record['settings'])
      atomic.write_json(_evaluation_file(config, workdir, regime, int(seed)), evaluation)
    searched[regime] = record['search']
  atomic.write_json(results, searched)
  return list(records)


def _differs(directory: str, settings: dict) -> bool:
  """Whether `directory` records other job settings than `settings` (nothing is written)."""
  recorded = os.path.exists(os.path.join(directory, workdir_lib.JOB_CONFIG))
  return recorded and not workdir_lib.recorded_as(directory, settings)


def _evaluation_file(config: ml_collections.ConfigDict, workdir: str, regime: str,
                     seed: int) -> str:
  return os.path.join(workdir_lib.evaluation_dir(_seed_workdir(config, workdir, seed), regime),
                      'results.json')


def _read_json(path: str, what: str) -> dict:
  if not os.path.exists(path):
    raise UserError(f'{path} is missing ({what})')
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise UserError(f'{path} is not JSON ({what}): {e}') from None


def _seeds(config: ml_collections.ConfigDict) -> list[int]:
  seeds = list(config.recipe_search.seeds)
  if not seeds or len(set(seeds)) != len(seeds) or \
      not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
    raise UserError(f'config.recipe_search.seeds = {tuple(seeds)}: at least one fine-tuning '
                    'seed, integers ≥ 0, none twice')
  return seeds


def _seed_run(config: ml_collections.ConfigDict, workdir: str, tasks: list[str], search: dict,
              seed: int) -> None:
  """Every regime fine-tuned again at its chosen recipe with finetune.seed = `seed`, and
  evaluated in a workdir of the seed's own (the same backbone and suite)."""
  seeded = ml_collections.ConfigDict(config.to_dict())
  seeded.finetune.seed = seed
  root = os.path.join(workdir, 'recipe_search')
  seed_workdir = _seed_workdir(config, workdir, seed)
  _share_backbone(workdir, seed_workdir)
  for regime in experiment.configured_regimes(config):
    chosen = search[regime.name]['chosen']
    point = ml_collections.ConfigDict(seeded.to_dict())
    point.finetune.update(learning_rate=chosen['learning_rate'], steps=chosen['steps'])
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


def over_seeds(by_seed: dict[int, dict]) -> dict:
  """{regime: {'seeds': [...], 'per_seed': {number: [one per seed]}, 'mean': {...}, 'std':
  {...}, 'per_task': {number: {task: mean over seeds}}}} of the `report.summary` numbers; std
  is the sample standard deviation (ddof 1; 0 for one seed). The per-task means (test
  accuracy fine-tuned, added, and of the negated target) show where a regime's means are
  won or lost."""
  seeds = list(by_seed)
  out = {}
  for regime in by_seed[seeds[0]]['regimes']:
    runs = [by_seed[s]['regimes'][regime] for s in seeds]
    rows = [report.summary(r) for r in runs]
    per_seed = {k: [row[k] for row in rows] for k in report.SUMMARY}
    measured = {k: [v for v in values if v is not None] for k, values in per_seed.items()}
    per_task = {number: {t: float(np.mean([of(r, t) for r in runs])) for t in runs[0]['tasks']}
                for number, of in _PER_TASK.items()}
    out[regime] = {
        'seeds': seeds, 'per_seed': per_seed,
        'mean': {k: float(np.mean(v)) if v else None for k, v in measured.items()},
        'std': {k: float(_std(v)) if v else None for k, v in measured.items()},
        'per_task': per_task}
  return out


_PER_TASK = {'pretrained': lambda r, t: r['pretrained'][t],
             'finetuned': lambda r, t: r['finetuned'][t]['test'],
             'addition': lambda r, t: r['addition']['test'][t],
             'negation_target': lambda r, t: r['negation'][t]['target_test']}


def plot_spread(by_seed: dict[int, dict], path: str) -> None:
  """Each regime's validation curves against α, the mean over seeds with ± one standard
  deviation shaded: addition (mean normalized accuracy) and negation (mean target accuracy over
  tasks, and dashed the control's, which bounds the α negation may use); and its mean ξ with
  the same spread."""
  plt = report.pyplot()
  fig, (addition, negation, xi) = plt.subplots(1, 3, figsize=(15, 4))
  seeds = list(by_seed)
  for i, regime in enumerate(by_seed[seeds[0]]['regimes']):
    runs, colour = [by_seed[s]['regimes'][regime] for s in seeds], f'C{i}'
    curve = runs[0]['addition']['curve']
    _band(addition, regime, colour, [p['alpha'] for p in curve],
          [[p['normalized_val'] for p in r['addition']['curve']] for r in runs])
    curve = runs[0]['negation'][runs[0]['tasks'][0]]['curve']
    for accuracy, label, style in (('target_val', regime, '-'), ('control_val', None, '--')):
      _band(negation, label, colour, [p['alpha'] for p in curve],
            [np.mean([[p[accuracy] for p in r['negation'][t]['curve']] for t in r['tasks']],
                     axis=0) for r in runs], style)
    means = [r['disentanglement']['mean'] for r in runs]
    if None not in means:
      xi.errorbar([regime], [np.mean(means)], yerr=[_std(means)], fmt='o', capsize=4,
                  color=colour)
  addition.set(title='task addition', xlabel='α', ylabel='mean normalized val accuracy')
  negation.set(title='task negation: target, control (dashed)', xlabel='α',
               ylabel='mean val accuracy')
  xi.set(title='weight disentanglement', ylabel='mean ξ')
  xi.tick_params(axis='x', labelrotation=20)
  addition.legend(fontsize=8)
  fig.suptitle(f'mean ± std over {len(seeds)} fine-tuning seeds')
  fig.tight_layout()
  report.save_png(fig, path)


def _band(ax, label: str | None, colour: str, alphas: list[float], curves: list,
          style: str = '-') -> None:
  """The mean of `curves` (one per seed) against `alphas`, ± one standard deviation shaded."""
  mean, std = np.mean(curves, axis=0), _std(curves)
  ax.plot(alphas, mean, style, color=colour, label=label)
  ax.fill_between(alphas, mean - std, mean + std, color=colour, alpha=0.2)


def _std(values) -> np.ndarray:
  """The sample standard deviation over the first axis (0 for one value)."""
  values = np.asarray(values, dtype=float)
  return np.std(values, axis=0, ddof=1) if len(values) > 1 else np.zeros(values.shape[1:])


def _seed_rows(search: dict, spread: dict) -> tuple[tuple[str, ...], list[list[str]]]:
  """Each regime at its chosen recipe: mean ± std over the seeds of every summary number."""
  header = ('regime', 'lr', 'steps', 'seeds', 'fine-tuned', 'addition', 'addition (norm.)',
            'negation target', 'negation control', 'mean ξ')
  rows = []
  for regime, r in spread.items():
    chosen = search[regime]['chosen']
    cells = []
    for k in report.SUMMARY:
      scale, digits = (1, 3) if k == 'xi' else (100, 1)
      cells.append('–' if r['mean'][k] is None else
                   f'{scale * r["mean"][k]:.{digits}f} ± {scale * r["std"][k]:.{digits}f}')
    rows.append([regime, f'{chosen["learning_rate"]:g}', str(chosen['steps']),
                 str(len(r['seeds']))] + cells)
  return header, rows


def seed_table(search: dict, spread: dict) -> str:
  return report.fixed_width(*_seed_rows(search, spread))


def _per_task_rows(spread: dict, cell) -> tuple[tuple[str, ...], list[list[str]]]:
  """A row per regime, a column per task, each cell `cell` of that task's per-task means (%)."""
  pretrained = next(iter(spread.values()))['per_task']['pretrained']
  rows = [['pretrained'] + [f'{100 * p:.1f}' for p in pretrained.values()]]
  for regime, r in spread.items():
    rows.append([regime] + [cell({k: 100 * v[t] for k, v in r['per_task'].items()})
                            for t in pretrained])
  return ('regime',) + tuple(pretrained), rows


def markdown(search: dict, spread: dict) -> str:
  """report.md: every point's mean validation accuracy (the chosen ones in bold), then each
  regime at its recipe over the seeds, overall and per task."""
  steps = sorted({p['steps'] for r in search.values() for p in r['points']})
  rows = []
  for regime, result in search.items():
    by_point = {(p['learning_rate'], p['steps']): p for p in result['points']}
    for rate in sorted({p['learning_rate'] for p in result['points']}):
      cells = []
      for n in steps:
        p = by_point.get((rate, n))
        cell = '' if p is None else f'{100 * p["mean_val"]:.1f}'
        cells.append(f'**{cell}**' if p == result['chosen'] else cell)
      rows.append([regime, f'{rate:g}'] + cells)
  return ('# Each regime at its own recipe\n\n'
          'Mean validation accuracy (%) over the tasks of each single-task fine-tune, at each '
          'point of the grid; the chosen point in bold.\n\n'
          + report.markdown_table(('regime', 'lr') + tuple(f'{n} steps' for n in steps), rows)
          + '\nAt the chosen recipes: test accuracy (%) and mean ξ, mean ± standard deviation '
          'over the fine-tuning seeds.\n\n'
          + report.markdown_table(*_seed_rows(search, spread))
          + '\nPer task, test accuracy (%) fine-tuned → under addition, mean over the seeds.\n\n'
          + report.markdown_table(*_per_task_rows(
              spread, lambda m: f'{m["finetuned"]:.1f} → {m["addition"]:.1f}'))
          + '\nPer task, the target\'s test accuracy (%) after negation, mean over the seeds.\n\n'
          + report.markdown_table(*_per_task_rows(
              spread, lambda m: f'{m["negation_target"]:.1f}')))


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


def at_edge(result: dict) -> list[str]:
  """Which of the chosen point's settings lie at an end of a range of three or more searched
  values (a wider range might choose past them; of two values, either is an end)."""
  edges = []
  for setting in ('learning_rate', 'steps'):
    values = sorted({p[setting] for p in result['points']})
    if len(values) > 2 and result['chosen'][setting] in (values[0], values[-1]):
      edges.append(setting)
  return edges


def table(search: dict) -> str:
  """Every point's mean validation accuracy per regime, the chosen one marked (and where its
  settings are on the grid's edge)."""
  lines = [f'{"regime":>15} {"lr":>8} {"steps":>6} {"mean val":>9}']
  for regime, result in search.items():
    edges = at_edge(result)
    for p in result['points']:
      mark = ''
      if p == result['chosen']:
        mark = '  <- chosen' + (f' ({" and ".join(edges)} on the grid\'s edge)' if edges else '')
      lines.append(f'{regime:>15} {p["learning_rate"]:8.0e} {p["steps"]:6d} '
                   f'{100 * p["mean_val"]:9.1f}{mark}')
  return '\n'.join(lines)


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
