"""editmerge against mergekit's own outputs: each recipe of `merging.mergekit.parity.RECIPES`
merged here from its YAML, compared with what mergekit 0.1.5 wrote for the same inputs
(tests/fixtures/mergekit/, made by its make.py); and the comparison job's own pieces."""

import os
import sys

import numpy as np
import pytest
import safetensors.numpy
import yaml

from configs import merge_checkpoints
from configs import quickstart
from editing.errors import UserError
from editing.models import hf
from merging import checkpoints
from merging.mergekit import methods
from merging.mergekit import parity
from merging.recipe import Recipe

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'mergekit')
BASE = os.path.join(FIXTURES, 'models', 'base')
MODELS = [os.path.join(FIXTURES, 'models', f'ft{k}') for k in range(3)]
# Their draws are not mergekit's (torch's generator): they agree in distribution only.
RANDOM = ('dare_ties', 'dare_linear', 'della', 'della_linear')
# Its importances are |τ|·KL(softmax θ ‖ softmax θ0) with KLs of ~1e-7 on these small deltas,
# below float32's resolution of p/q: the entries near the threshold fall either way.
ROUNDING_BOUND = ('arcee_fusion',)
EXACT = sorted(set(parity.RECIPES) - set(RANDOM) - set(ROUNDING_BOUND))


def merged(tmp_path, name: str) -> tuple[dict, dict, dict]:
  """Ours, mergekit's and the base's tensors of recipe `name` (float64)."""
  config = merge_checkpoints.get_config()
  path = tmp_path / 'merge.yaml'
  path.write_text(parity.recipe(name, BASE, MODELS))
  config.update(mergekit=str(path), output=str(tmp_path / 'out'))
  checkpoints.run(config, str(tmp_path))
  ours = hf.Checkpoint(config.output)
  theirs = safetensors.numpy.load_file(os.path.join(FIXTURES, 'outputs', f'{name}.safetensors'))
  base = hf.Checkpoint(BASE)
  assert sorted(ours.files) == sorted(theirs)
  return ({n: ours.tensor(n).astype(np.float64) for n in theirs},
          {n: x.astype(np.float64) for n, x in theirs.items()},
          {n: base.tensor(n).astype(np.float64) for n in base.files})


def moved(tensors: dict, base: dict) -> tuple[float, float]:
  """The share of the base's entries a merge changed, and Σ|θ − θ0| over them."""
  changed = sum(int((tensors[n] != x0).sum()) for n, x0 in base.items())
  total = sum(x0.size for x0 in base.values())
  return changed / total, sum(float(np.abs(tensors[n] - x0).sum()) for n, x0 in base.items())


@pytest.mark.parametrize('name', EXACT)
def test_deterministic_recipes_match_mergekits_outputs(tmp_path, name):
  ours, theirs, _ = merged(tmp_path, name)
  for n, y in theirs.items():
    np.testing.assert_allclose(ours[n], y, rtol=1e-6, atol=1e-7, err_msg=n)


@pytest.mark.parametrize('name', RANDOM + ROUNDING_BOUND)
def test_random_and_rounding_bound_recipes_match_mergekits_in_distribution(tmp_path, name):
  """The share of entries changed within 0.01, Σ|θ − θ0| within 5% of mergekit's."""
  ours, theirs, base = merged(tmp_path, name)
  (our_share, our_sum), (their_share, their_sum) = moved(ours, base), moved(theirs, base)
  assert abs(our_share - their_share) < 0.01
  assert our_sum / their_sum == pytest.approx(1, abs=0.05)


def test_every_recipe_is_a_mergekit_config_the_reader_takes(tmp_path):
  for name in parity.RECIPES:
    text = parity.recipe(name, BASE, MODELS)
    assert yaml.safe_load(text)['merge_method'] in methods.METHODS
    (tmp_path / 'merge.yaml').write_text(text)
    assert Recipe.from_mergekit(str(tmp_path / 'merge.yaml')).models, name


def test_compare_finds_the_largest_difference_and_the_ratio_of_deltas(tmp_path):
  base = {'w': np.zeros((2, 2), np.float32)}
  ours = {'w': np.array([[1.0, -1.0], [2.0, 0.0]], np.float32)}
  theirs = {'w': np.array([[1.0, -1.0], [1.0, 0.0]], np.float32)}
  for name, tensors in (('base', base), ('ours', ours), ('theirs', theirs)):
    hf.save(str(tmp_path / name), tensors, {}, shard_bytes=10**9)
  result = parity.compare(*(str(tmp_path / n) for n in ('base', 'ours', 'theirs')))
  assert result['max_difference'] == 1.0
  assert result['delta_ratio'] == pytest.approx(4 / 3)


@pytest.mark.parametrize('settings, message', [
    (dict(mergekit=''), "give the path of an installed mergekit's mergekit-yaml"),
    (dict(mergekit=sys.executable, recipes='ties,frankenmerge'),
     r"\['frankenmerge'\] are not recipes"),
    (dict(mergekit=sys.executable, fixture='llama-7b'),
     r"config.benchmark.fixture = 'llama-7b': one of \['benchmark', 'llama_1b', 'tiny'\]"),
])
def test_a_missing_command_or_an_unknown_recipe_is_named(tmp_path, settings, message):
  config = quickstart.get_config('tiny')
  config.benchmark.update(job='mergekit', **settings)
  with pytest.raises(UserError, match=message):
    parity.run(config, str(tmp_path))
  assert os.listdir(tmp_path) == []
