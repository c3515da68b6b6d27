"""mergekit's conventions: its weighted merges against a numpy reference, and its YAML recipes
read onto the checkpoint merge (merging/jobs/mergekit.py)."""

import os

import ml_dtypes
import numpy as np
import pytest

from configs import merge_checkpoints as merge_checkpoints_config
from editing.errors import UserError
from merging import checkpoints
from tests import checkpoint_reference as reference
from tests.test_checkpoint_merging import bits, fixture


def test_weighted_merges_follow_mergekits_conventions(tmp_path):
  base, models = fixture(str(tmp_path))
  weights = (0.5, 1.0, 2.0)
  theta0 = reference.read_output(base)
  thetas = [reference.read_output(m) for m in models]
  plans = {
      'ta': checkpoints.Plan('task_arithmetic', {'normalize': True}, scale=0.7, weights=weights),
      'ties': checkpoints.Plan('ties', {'density': 0.2, 'scope': 'tensor'}, scale=0.9,
                               weights=weights),
  }
  merged = {}
  for name, plan in plans.items():
    checkpoints.merge(base, models, str(tmp_path / name), plan)
    merged[name] = reference.read_output(str(tmp_path / name))
    expected = reference.in_memory(base, models, plan)
    for n, x in expected.items():
      np.testing.assert_array_equal(bits(merged[name][n]), bits(x), err_msg=n)
  w = np.asarray(weights)[:, None]
  for n, x0 in theta0.items():
    deltas = np.stack([t[n] - x0 for t in thetas]).reshape(3, -1).astype(np.float64)
    linear = (w * deltas).sum(0) / w.sum()
    np.testing.assert_allclose(merged['ta'][n], x0 + 0.7 * linear.reshape(x0.shape),
                               rtol=1e-5, atol=1e-6)
    count = max(1, int(0.2 * deltas.shape[1]))
    trimmed = np.zeros_like(deltas)
    for t in range(3):
      keep = np.argsort(-np.abs(deltas[t]), kind='stable')[:count]
      trimmed[t, keep] = deltas[t, keep]
    weighted = w * trimmed
    sign = np.where(weighted.sum(0) >= 0, 1.0, -1.0)
    agree = (np.sign(weighted) == sign) & (weighted != 0)
    divisor = (agree * w).sum(0)
    mean = (weighted * agree).sum(0) / np.where(divisor == 0, 1.0, divisor)
    np.testing.assert_allclose(merged['ties'][n], x0 + 0.9 * mean.reshape(x0.shape), rtol=1e-5,
                               atol=1e-6)


def mergekit_yaml(path, text):
  with open(path, 'w') as f:
    f.write(text)
  return str(path)


def test_a_mergekit_yaml_runs_the_same_merge_as_the_flags(tmp_path):
  base, models = fixture(str(tmp_path))
  config = merge_checkpoints_config.get_config()
  config.mergekit = mergekit_yaml(tmp_path / 'merge.yaml', f'''
models:
  - model: {base}
  - model: {models[0]}
    parameters: {{weight: 0.6, density: 0.3}}
  - model: {models[1]}
    parameters: {{weight: 0.4, density: 0.3}}
merge_method: ties
base_model: {base}
parameters:
  normalize: true
  lambda: 0.8
dtype: bfloat16
''')
  config.output = str(tmp_path / 'from_yaml')
  checkpoints.run(config, str(tmp_path))
  plan = checkpoints.Plan('ties', {'density': 0.3, 'scope': 'tensor', 'normalize': True},
                          scale=0.8, weights=(0.6, 0.4), dtype='bfloat16')
  checkpoints.merge(base, models[:2], str(tmp_path / 'from_plan'), plan)
  from_yaml = reference.read_output(str(tmp_path / 'from_yaml'))
  from_plan = reference.read_output(str(tmp_path / 'from_plan'))
  assert from_yaml.keys() == from_plan.keys()
  for n, x in from_plan.items():
    assert x.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bits(from_yaml[n]), bits(x), err_msg=n)


@pytest.mark.parametrize('text, message', [
    ('merge_method: slerp\nbase_model: b\nmodels: [{model: a}]',
     "merge_method 'slerp' is not supported"),
    ('merge_method: ties\nbase_model: b\nmodels: [{model: a}]\nslices: []',
     'slices not supported here'),
    ('merge_method: ties\nbase_model: b\nmodels: [{model: a, parameters: {gamma: 0.1}}]',
     r'models\[0\].parameters.gamma not supported'),
    ('merge_method: ties\nbase_model: b\nmodels: [{model: a, parameters: {density: 0.2}}, '
     '{model: c, parameters: {density: 0.4}}]', r'different densities \[0.2, 0.4\]'),
    ('merge_method: ties\nmodels: [{model: a}]', 'base_model is required'),
    ('merge_method: ties\nbase_model: b\nmodels: [{model: a, parameters: {weight: [0, 1]}}]',
     r'models\[0\].parameters.weight = \[0, 1\] must be a number'),
    ('merge_method: ties\nbase_model: b\nparameters: {density: [0.2, 0.5]}\n'
     'models: [{model: a}]', r': parameters.density = \[0.2, 0.5\] must be a number'),
])
def test_unsupported_mergekit_keys_are_named(tmp_path, text, message):
  config = merge_checkpoints_config.get_config()
  config.mergekit = mergekit_yaml(tmp_path / 'merge.yaml', text)
  with pytest.raises(UserError, match=message):
    checkpoints.run(config, str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ['merge.yaml']
