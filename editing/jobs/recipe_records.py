"""The recipe search's evaluations at every seed, and the records that carry them between
workdirs.

The search's own seed (the first of its seeds) is evaluated in the workdir itself, each other
seed s in <workdir>/recipe_search/seed<s>/. A record, <directory>/<regime>.json, holds one
regime's search and its evaluations at every seed, so that regimes searched in separate
workdirs, on other machines or days, gather into one report (`save_records`,
`restore_records`).
"""

import json
import os

from absl import logging

from editing import atomic
from editing.errors import UserError
from editing.jobs import workdir as workdir_lib


def seed_workdir(workdir: str, seed: int, search_seed: int) -> str:
  """Where the fine-tunes and evaluation at `seed` live."""
  if seed == search_seed:
    return workdir
  return os.path.join(workdir, 'recipe_search', f'seed{seed}')


def evaluation_file(workdir: str, regime: str, seed: int, search_seed: int) -> str:
  return os.path.join(workdir_lib.evaluation_dir(seed_workdir(workdir, seed, search_seed), regime),
                      'results.json')


def evaluations(workdir: str, names: list[str], seeds: list[int],
                search_seed: int) -> dict[int, dict]:
  """{seed: {'regimes': {regime: its evaluation}}} for every regime of `names` this workdir
  holds an evaluation of at every seed (read from each seed's
  evaluation/<regime>/results.json); the others are named in a warning."""
  found = {}
  for regime in names:
    files = [evaluation_file(workdir, regime, s, search_seed) for s in seeds]
    missing = [s for s, f in zip(seeds, files) if not os.path.exists(f)]
    if missing:
      logging.warning('recipe search: %s has no evaluation at seeds %s; it is left out of '
                      'seeds.json, seeds.png and report.md', regime, missing)
      continue
    for seed, file in zip(seeds, files):
      with open(file) as f:
        found.setdefault(seed, {'regimes': {}})['regimes'][regime] = json.load(f)
  return found


def save_records(workdir: str, directory: str, search_seed: int) -> list[str]:
  """Each regime this workdir searched and evaluated at every seed (those of
  recipe_search/seeds.json) as <directory>/<regime>.json: {'search': its entry of
  recipe_search/results.json, 'evaluations': {seed: evaluation/<regime>/results.json of that
  seed}, 'settings': what those evaluations depend on besides the vectors (the evaluation's
  job_config.json)}. Returns the regimes saved.

  Regimes searched in separate workdirs, on other machines or days, are gathered into one by
  `restore_records`.
  """
  root = os.path.join(workdir, 'recipe_search')
  spread = read_json(os.path.join(root, 'seeds.json'),
                     'written once a recipe search has evaluated its regimes at every seed')
  searched = read_json(os.path.join(root, 'results.json'), 'the recipe search\'s points')
  settings = read_json(os.path.join(workdir_lib.evaluation_root(workdir), workdir_lib.JOB_CONFIG),
                       'the evaluation\'s settings')
  for regime, numbers in spread.items():
    evaluations_of = {str(s): read_json(evaluation_file(workdir, regime, s, search_seed),
                                        f'the evaluation of {regime} at seed {s}')
                      for s in numbers['seeds']}
    atomic.write_json(os.path.join(directory, f'{regime}.json'),
                      {'search': searched[regime], 'evaluations': evaluations_of,
                       'settings': settings})
  return list(spread)


def restore_records(workdir: str, directory: str, search_seed: int) -> list[str]:
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
    searched = read_json(results, 'the recipe search\'s points')
  records = {}
  for name in sorted(n for n in os.listdir(directory) if n.endswith('.json')):
    path = os.path.join(directory, name)
    record = read_json(path, 'a recipe search record')
    if set(record) != {'search', 'evaluations', 'settings'}:
      raise UserError(f'{path} is not a recipe search record (its keys are '
                      f'{sorted(record)}, not evaluations, search and settings)')
    regime = name.removesuffix('.json')
    if not searched.get(regime, {}).get('complete'):
      records[regime] = record
  for regime, record in records.items():
    for seed in record['evaluations']:
      evaluation_root = workdir_lib.evaluation_root(
          seed_workdir(workdir, int(seed), search_seed))
      if _differs(evaluation_root, record['settings']):
        raise UserError(f'{os.path.join(directory, regime)}.json was evaluated with other '
                        f'settings than {evaluation_root}; restore it into another workdir')
  for regime, record in records.items():
    for seed, evaluation in record['evaluations'].items():
      workdir_lib.check_job_config(
          workdir_lib.evaluation_root(seed_workdir(workdir, int(seed), search_seed)),
          record['settings'])
      atomic.write_json(evaluation_file(workdir, regime, int(seed), search_seed), evaluation)
    searched[regime] = record['search']
  atomic.write_json(results, searched)
  return list(records)


def _differs(directory: str, settings: dict) -> bool:
  """Whether `directory` records other job settings than `settings` (nothing is written)."""
  recorded = os.path.exists(os.path.join(directory, workdir_lib.JOB_CONFIG))
  return recorded and not workdir_lib.recorded_as(directory, settings)


def read_json(path: str, what: str) -> dict:
  """The JSON file at `path`, or an error naming it and `what` it holds."""
  if not os.path.exists(path):
    raise UserError(f'{path} is missing ({what})')
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise UserError(f'{path} is not JSON ({what}): {e}') from None
