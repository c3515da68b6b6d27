"""editmerge against mergekit on the same YAML recipes, where mergekit is installed.

  python -m launch.benchmark --config.benchmark.job=mergekit \
      --config.benchmark.mergekit=/path/to/bin/mergekit-yaml [--config.benchmark.recipes=ties,slerp]

Each recipe of RECIPES (one or two per method, mergekit's defaults unless it says otherwise)
runs through both tools, each in its own process, whole process timed, on a generated
Llama-shaped fixture (a base and three fine-tunes) of `config.benchmark.fixture`, one of
`merging.jobs.checkpoint_benchmark.FIXTURES`: 'tiny' (where start-up is most of the time; the
default), 'benchmark' (136M parameters a model) or 'llama_1b' (Llama-3.2-1B's shapes in
bfloat16). The table reports each output's largest difference from mergekit's, and the ratio
of their Σ |θ − θ0| (a random method, DARE or DELLA, draws other masks than mergekit's: its
outputs agree only in distribution, so that ratio is its measure). mergekit is not a
dependency: it is run as the command given; tests/fixtures/mergekit/ holds its outputs of
these recipes on a tiny model. Both outputs of a recipe are removed once compared.
"""

import os
import shutil
import subprocess
import sys
import time

import numpy as np

from editing import atomic
from editing.errors import UserError
from editing.models import hf
from merging.jobs import checkpoint_benchmark

RANDOM = ('dare_ties', 'dare_linear', 'della', 'della_linear')
_W = ['{weight: 0.5, density: 0.4}', '{weight: 1.0, density: 0.4}', '{weight: 1.5, density: 0.4}']
# name -> (merge_method, base_model given, global parameters, per-model parameters or None)
RECIPES = {
    'linear': ('linear', False, None, ['{weight: 1.0}', '{weight: 2.0}', '{weight: 1.0}']),
    'task_arithmetic': ('task_arithmetic', True, '{lambda: 0.7}', _W),
    'ties': ('ties', True, None, _W),
    'dare_ties': ('dare_ties', True, None, _W),
    'dare_linear': ('dare_linear', True, None, _W),
    'breadcrumbs': ('breadcrumbs', True, '{gamma: 0.05}', _W),
    'breadcrumbs_ties': ('breadcrumbs_ties', True, '{gamma: 0.05}', _W),
    'breadcrumbs_gradient': ('breadcrumbs', True, '{gamma: 0.05, density: [0.2, 0.6]}',
                             ['{weight: 0.5}', '{weight: 1.0}', '{weight: 1.5}']),
    'della': ('della', True, '{epsilon: 0.1}', _W),
    'della_linear': ('della_linear', True, '{epsilon: 0.1}', _W),
    'sce': ('sce', True, '{select_topk: 0.5}', None),
    'model_stock': ('model_stock', True, None, None),
    'model_stock_filter_wise': ('model_stock', True, '{filter_wise: true}', None),
    'slerp': ('slerp', True, '{t: 0.3}', None),
    'nuslerp': ('nuslerp', False, '{nuslerp_flatten: false}', ['{weight: 1.0}', '{weight: 3.0}']),
    'nuslerp_base': ('nuslerp', True, None, ['{weight: 1.0}', '{weight: 3.0}']),
    'multislerp': ('multislerp', True, None, ['{weight: 1.0}', '{weight: 2.0}', '{weight: 1.0}']),
    'karcher': ('karcher', False, None, None),
    'nearswap': ('nearswap', True, '{t: 0.01}', None),
    'arcee_fusion': ('arcee_fusion', True, None, None),
}
# Recipes of slices: name -> (merge_method, global parameters, per slice the layer range of
# the base then of each model merged).
SLICED = {
    'ties_slices': ('ties', '{density: 0.4, weight: 1.0}', [[(0, 1), (1, 2), (0, 1)],
                                                            [(1, 2), (0, 1), (1, 2)]]),
    'slerp_slices': ('slerp', '{t: [{filter: self_attn, value: [0, 1]}, {value: 0.5}]}',
                     [[(0, 2), (0, 2)], [(1, 2), (0, 1)]]),
}
RECIPES.update({name: (method, True, parameters, None)
                for name, (method, parameters, _) in SLICED.items()})
_ONE_MODEL = ('slerp', 'nearswap', 'arcee_fusion')
_TWO_MODELS = ('nuslerp',)


def recipe(name: str, base: str, models: list[str]) -> str:
  """The YAML text of recipe `name` over the fixture's models."""
  if name in SLICED:
    method, parameters, slices = SLICED[name]
    lines = [f'merge_method: {method}', f'base_model: {base}', f'parameters: {parameters}',
             'slices:']
    for ranges in slices:
      lines.append('  - sources:')
      for model, (first, end) in zip([base] + models, ranges):
        lines += [f'    - model: {model}', f'      layer_range: [{first}, {end}]']
    return '\n'.join(lines) + '\n'
  method, with_base, parameters, per_model = RECIPES[name]
  count = 1 if method in _ONE_MODEL else 2 if method in _TWO_MODELS else len(models)
  lines = [f'merge_method: {method}']
  if with_base:
    lines.append(f'base_model: {base}')
  if parameters:
    lines.append(f'parameters: {parameters}')
  lines.append('models:')
  for i, model in enumerate(models[:count]):
    lines.append(f'  - model: {model}')
    if per_model:
      lines.append(f'    parameters: {per_model[i]}')
  return '\n'.join(lines) + '\n'


def _timed(command: list[str]) -> float:
  start = time.time()
  proc = subprocess.run(command, capture_output=True, text=True)
  if proc.returncode:
    raise UserError(f'{command[0]} failed on {command[1]}:\n{proc.stderr[-2000:]}')
  return time.time() - start


def compare(base: str, ours: str, theirs: str) -> dict:
  """The largest |ours − theirs| and the ratio of Σ|θ − θ0| over the tensors the base holds
  under the same name (a merge of slices may have more layers; where one of mergekit's
  tensors is θ0 itself, a per-tensor ratio would not be defined)."""
  base_ckpt, a, b = hf.Checkpoint(base), hf.Checkpoint(ours), hf.Checkpoint(theirs)
  largest, ours_moved, theirs_moved = 0.0, 0.0, 0.0
  for name in sorted(a.files):
    x, y = a.tensor(name).astype(np.float64), b.tensor(name).astype(np.float64)
    largest = max(largest, float(np.abs(x - y).max()))
    if name in base_ckpt.files:
      x0 = base_ckpt.tensor(name).astype(np.float64)
      ours_moved += np.abs(x - x0).sum()
      theirs_moved += np.abs(y - x0).sum()
  return {'max_difference': largest,
          'delta_ratio': float(ours_moved / max(theirs_moved, 1e-30))}


def run(config, workdir: str) -> dict:
  mergekit = config.benchmark.get('mergekit', '')
  if not mergekit or not os.access(mergekit, os.X_OK):
    raise UserError(f'config.benchmark.mergekit = {mergekit!r}: give the path of an installed '
                    "mergekit's mergekit-yaml command")
  names = [n for n in config.benchmark.get('recipes', '').split(',') if n] or list(RECIPES)
  unknown = sorted(set(names) - set(RECIPES))
  if unknown:
    raise UserError(f'config.benchmark.recipes: {unknown} are not recipes; known: '
                    f'{sorted(RECIPES)}')
  fixture = config.benchmark.fixture or 'tiny'
  fixtures = checkpoint_benchmark.FIXTURES
  if fixture not in fixtures:
    raise UserError(f'config.benchmark.fixture = {fixture!r}: one of {sorted(fixtures)}')
  directory, shape = checkpoint_benchmark.fixture_directory(fixture), fixtures[fixture]
  base, models = checkpoint_benchmark.make_fixture(os.path.join(workdir, directory), shape)
  results = {}
  for name in names:
    directory = os.path.join(workdir, 'mergekit_parity', name)
    os.makedirs(directory, exist_ok=True)
    yaml_path = os.path.join(directory, 'merge.yaml')
    atomic.write_bytes(yaml_path, recipe(name, base, models).encode())
    theirs, ours = os.path.join(directory, 'mergekit'), os.path.join(directory, 'editmerge')
    results[name] = {
        'mergekit_seconds': _timed([mergekit, yaml_path, theirs, '--random-seed', '0']),
        'editmerge_seconds': _timed([sys.executable, '-m', 'launch.merge_checkpoints',
                                     f'--config.mergekit={yaml_path}', f'--config.output={ours}',
                                     '--config.overwrite=True', f'--workdir={directory}']),
        **compare(base, ours, theirs)}
    for output in (theirs, ours):  # a 1B fixture's are 2.5 GB each
      shutil.rmtree(output)
  lines = ['recipe              max |editmerge − mergekit|    Σ|Δ| ratio   editmerge s   '
           'mergekit s']
  for name, r in results.items():
    note = ' (random: other draws)' if name in RECIPES and RECIPES[name][0] in RANDOM else ''
    lines.append(f'{name:19} {r["max_difference"]:26.2e} {r["delta_ratio"]:15.4f} '
                 f'{r["editmerge_seconds"]:13.1f} {r["mergekit_seconds"]:12.1f}{note}')
  print('\n'.join(lines))
  summary = {'fixture': shape, 'results': results}
  atomic.write_json(os.path.join(workdir, 'mergekit_parity.json'), summary)
  return summary
