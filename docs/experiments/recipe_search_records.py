"""The recipe search's record of each regime, kept beside this file, so that regimes searched
in separate workdirs, on other machines or days, gather into one set of tables and one figure.

  python docs/experiments/recipe_search_records.py save workdir/recipes
  python docs/experiments/recipe_search_records.py restore workdir/recipes

`save` writes recipe_search/<regime>.json here for every regime of the workdir's
recipe_search/seeds.json (those searched and evaluated at every seed): {'search': its entry of
recipe_search/results.json, 'evaluations': {seed: that seed's evaluation/<regime>/results.json}}. `restore` puts each one
whose regime the workdir lacks back in its place; a later `launch.recipe_search` of other
regimes in that workdir then shows them beside its own (as it shows a regime an earlier run
of the same workdir searched), with the seeds they were evaluated at. Both take the workdir's
own fine-tuning seed to be the default config's finetune.seed.
"""

import json
import os
import sys

from configs import quickstart as quickstart_config
from editing import atomic
from editing.jobs import workdir as workdir_lib

RECORDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'recipe_search')


def _evaluation_file(workdir: str, regime: str, seed: int, first_seed: int) -> str:
  seed_workdir = workdir if seed == first_seed else os.path.join(
      workdir, 'recipe_search', f'seed{seed}')
  return os.path.join(workdir_lib.evaluation_dir(seed_workdir, regime), 'results.json')


def _read(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def save(workdir: str) -> list[str]:
  first = quickstart_config.get_config(None).finetune.seed
  searched = _read(os.path.join(workdir, 'recipe_search', 'results.json'))
  saved = []
  for regime, spread in _read(os.path.join(workdir, 'recipe_search', 'seeds.json')).items():
    record = {'search': searched[regime],
              'evaluations': {str(s): _read(_evaluation_file(workdir, regime, s, first))
                              for s in spread['seeds']}}
    atomic.write_json(os.path.join(RECORDS, f'{regime}.json'), record)
    saved.append(regime)
  return saved


def restore(workdir: str) -> list[str]:
  first = quickstart_config.get_config(None).finetune.seed
  results = os.path.join(workdir, 'recipe_search', 'results.json')
  searched = _read(results) if os.path.exists(results) else {}
  restored = []
  for name in sorted(os.listdir(RECORDS)):
    regime, record = name.removesuffix('.json'), _read(os.path.join(RECORDS, name))
    if searched.get(regime, {}).get('complete'):
      continue
    for seed, evaluation in record['evaluations'].items():
      atomic.write_json(_evaluation_file(workdir, regime, int(seed), first), evaluation)
    searched[regime] = record['search']
    restored.append(regime)
  atomic.write_json(results, searched)
  return restored


if __name__ == '__main__':
  verb, workdir = sys.argv[1], sys.argv[2]
  done = {'save': save, 'restore': restore}[verb](workdir)
  print(f'{verb}: {", ".join(done) or "nothing"}')
