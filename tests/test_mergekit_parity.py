"""The mergekit comparison job, with a stand-in for mergekit's command (mergekit is not a
dependency): its recipes, its comparison and its errors."""

import os
import stat
import sys

import numpy as np
import pytest
import yaml

from configs import merge_checkpoints
from configs import quickstart
from editing.errors import UserError
from editing.models import hf
from merging.jobs import mergekit
from merging.jobs import mergekit_methods
from merging.jobs import mergekit_parity

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stand_in(tmp_path) -> str:
  """A `mergekit-yaml CONFIG OUT ...` that runs editmerge's own merge of CONFIG into OUT."""
  path = tmp_path / 'mergekit-yaml'
  path.write_text(f'#!/bin/sh\ncd {REPO} && exec {sys.executable} -m launch.merge_checkpoints '
                  '--config.mergekit="$1" --config.output="$2" --workdir="$2.work"\n')
  path.chmod(path.stat().st_mode | stat.S_IEXEC)
  return str(path)


def test_every_recipe_is_a_mergekit_config_the_reader_takes(tmp_path):
  base, models = str(tmp_path / 'base'), [str(tmp_path / f'ft{k}') for k in range(3)]
  for path in [base] + models:
    os.makedirs(path)
  for name in mergekit_parity.RECIPES:
    text = mergekit_parity.recipe(name, base, models)
    assert yaml.safe_load(text)['merge_method'] in mergekit_methods.METHODS
    (tmp_path / 'merge.yaml').write_text(text)
    config = mergekit.apply(merge_checkpoints.get_config(), str(tmp_path / 'merge.yaml'))
    assert config.models, name


def test_the_job_compares_the_two_outputs(tmp_path):
  config = quickstart.get_config('tiny')
  config.benchmark.update(job='mergekit', mergekit=stand_in(tmp_path), recipes='slerp')
  summary = mergekit_parity.run(config, str(tmp_path))
  result = summary['results']['slerp']
  assert result['max_difference'] == 0 and result['delta_ratio'] == 1.0


def test_compare_finds_the_largest_difference_and_the_ratio_of_deltas(tmp_path):
  base = {'w': np.zeros((2, 2), np.float32)}
  ours = {'w': np.array([[1.0, -1.0], [2.0, 0.0]], np.float32)}
  theirs = {'w': np.array([[1.0, -1.0], [1.0, 0.0]], np.float32)}
  for name, tensors in (('base', base), ('ours', ours), ('theirs', theirs)):
    hf.save(str(tmp_path / name), tensors, {}, shard_bytes=10**9)
  result = mergekit_parity.compare(*(str(tmp_path / n) for n in ('base', 'ours', 'theirs')))
  assert result['max_difference'] == 1.0
  assert result['delta_ratio'] == pytest.approx(4 / 3)


@pytest.mark.parametrize('settings, message', [
    (dict(mergekit=''), "give the path of an installed mergekit's mergekit-yaml"),
    (dict(mergekit=sys.executable, recipes='ties,frankenmerge'),
     r"\['frankenmerge'\] are not recipes"),
    (dict(mergekit=sys.executable, fixture='llama-7b'),
     r"config.benchmark.fixture = 'llama-7b': one of \['benchmark', 'tiny'\]"),
])
def test_a_missing_command_or_an_unknown_recipe_is_named(tmp_path, settings, message):
  config = quickstart.get_config('tiny')
  config.benchmark.update(job='mergekit', **settings)
  with pytest.raises(UserError, match=message):
    mergekit_parity.run(config, str(tmp_path))
  assert os.listdir(tmp_path) == []
