"""mergekit's conventions: its weighted merges against a numpy reference, and its YAML recipes
read onto the checkpoint merge (merging/mergekit/reader.py)."""

import json
import logging
import math
import os

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from configs import merge_checkpoints as merge_checkpoints_config
from configs import quickstart
from editing.errors import UserError
from editing.models import hf
from merging import checkpoints
from merging.checkpoints import layered
from merging.jobs import checkpoint_benchmark
from merging import recipe as recipe_lib
from tests import checkpoint_reference as reference
from tests import references
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
    ('merge_method: arcee_fusion\nbase_model: b\nmodels: [{model: a}, {model: c}]',
     'arcee_fusion merges 1 model besides the base, got 2'),
    ('merge_method: ties\nbase_model: b\nmodels: [{model: a}]\nslices: []',
     'give the models in models or in slices, not both'),
    ('merge_method: ties\nbase_model: b\nmodels: [{model: a, parameters: {gama: 0.1}}]',
     r'models\[0\].parameters.gama not supported'),
    ('merge_method: breadcrumbs\nbase_model: b\nmodels: [{model: a, parameters: {density: 0.2}}, '
     '{model: c, parameters: {density: 0.4}}]',
     r'different values of density \(\[0.2, 0.4\]\); breadcrumbs takes one density'),
    ('merge_method: slerp\nbase_model: b\nmodels: [{model: a}]',
     'slerp requires parameters.t'),
    ('merge_method: nearswap\nbase_model: b\nmodels: [{model: a}]',
     'nearswap requires parameters.t'),
    ('merge_method: slerp\nbase_model: b\nparameters: {t: 0.5}\nmodels: [{model: a}, '
     '{model: c}]', 'slerp merges 1 model besides the base, got 2'),
    ('merge_method: dare_ties\nbase_model: b\nparameters: {rescale: false}\n'
     'models: [{model: a}]', 'parameters.rescale = False is not supported here for dare'),
    ('merge_method: ties\nmodels: [{model: a}]', 'base_model is required'),
    ('merge_method: ties\nbase_model: b\nmodels: [{model: a, parameters: {weight: '
     '[{filter: mlp}]}}]', r'models\[0\].parameters.weight\[0\] = .*a \{filter, value\} entry'),
    ('merge_method: ties\nbase_model: b\nparameters: {density: [0.2, {a: 1}]}\n'
     'models: [{model: a}]', r': parameters.density\[0\] = 0.2: a \{filter, value\} entry'),
])
def test_unsupported_mergekit_keys_are_named(tmp_path, text, message):
  config = merge_checkpoints_config.get_config()
  config.mergekit = mergekit_yaml(tmp_path / 'merge.yaml', text)
  with pytest.raises(UserError, match=message):
    checkpoints.run(config, str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ['merge.yaml']


# mergekit 0.1.5's defaults per method (generalized_task_arithmetic.py, registry.py, sce.py,
# karcher.py, nuslerp.py), in the settings of the method each one runs here.
DEFAULTS = {
    'linear': ('task_arithmetic', {'normalize': True}),
    'task_arithmetic': ('task_arithmetic', {'normalize': False}),
    'ties': ('ties', {'normalize': True, 'density': 1.0, 'scope': 'tensor'}),
    'dare_ties': ('dare', {'then': 'ties', 'normalize': False, 'rescale': 'l1_norm', 'p': 0.0,
                           'density': 1.0, 'scope': 'tensor'}),
    'dare_linear': ('dare', {'then': 'task_arithmetic', 'normalize': False,
                             'rescale': 'l1_norm', 'p': 0.0}),
    'breadcrumbs': ('breadcrumbs', {'elect_sign': False, 'normalize': False, 'top': 0.0,
                                    'bottom': 0.0}),
    'breadcrumbs_ties': ('breadcrumbs', {'elect_sign': True, 'normalize': False, 'top': 0.0,
                                         'bottom': 0.0}),
    'della': ('della', {'elect_sign': True, 'normalize': True, 'rescale': 'l1_norm',
                        'density': 1.0, 'epsilon': 0.15}),
    'della_linear': ('della', {'elect_sign': False, 'normalize': False, 'rescale': 'l1_norm',
                               'density': 1.0, 'epsilon': 0.15}),
    'sce': ('sce', {'select_topk': 1.0}),
    'model_stock': ('model_stock', {'clip': False}),
    'multislerp': ('multislerp', {'task_space': True}),
    'karcher': ('karcher', {'max_iter': 10, 'tol': 1e-5, 'task_space': False}),
}


def test_nearswap_and_arcee_fusion_take_one_model_and_nearswap_its_threshold(tmp_path):
  base, models = fixture(str(tmp_path))
  config = read(tmp_path, f'merge_method: nearswap\nbase_model: {base}\nparameters: {{t: 0.01}}'
                f'\nmodels: [{{model: {base}}}, {{model: {models[0]}}}]')
  assert (config.method, config.settings['t'], config.scale) == ('nearswap', 0.01, 1.0)
  assert config.models == (models[0],)
  fusion = read(tmp_path, f'merge_method: arcee_fusion\nbase_model: {base}\n'
                f'models: [{{model: {models[1]}}}]')
  assert (fusion.method, fusion.models, fusion.scale) == ('arcee_fusion', (models[1],), 1.0)
  zero = merge_checkpoints_config.get_config()
  zero.mergekit = mergekit_yaml(tmp_path / 'zero.yaml', f'merge_method: nearswap\nbase_model: '
                                f'{base}\nparameters: {{t: 0.0}}\nmodels: [{{model: {models[0]}}}]')
  output = tmp_path / 'out'
  with pytest.raises(UserError, match=r'nearswap.t = 0.0: must be a number in \(0, inf\)'):
    checkpoints.run(zero, str(output))
  assert not os.path.exists(output)


def read(tmp_path, text):
  return recipe_lib.Recipe.from_mergekit(mergekit_yaml(tmp_path / 'merge.yaml', text))


@pytest.mark.parametrize('method', sorted(DEFAULTS))
def test_each_mergekit_method_runs_with_mergekits_defaults(tmp_path, method):
  base, models = fixture(str(tmp_path))
  config = read(tmp_path, f'merge_method: {method}\nbase_model: {base}\n'
                f'models: [{{model: {models[0]}}}, {{model: {models[1]}}}]')
  ours, expected = DEFAULTS[method]
  assert config.method == ours and config.scale == 1.0
  assert {k: config.settings[k] for k in expected} == expected


def test_per_model_parameters_and_lambda_map_onto_the_settings(tmp_path):
  base, models = fixture(str(tmp_path))
  two = f'base_model: {base}\nmodels:\n' + ''.join(
      f'  - {{model: {m}, parameters: {{weight: {w}, density: 0.3}}}}\n'
      for m, w in zip(models, (0.25, 0.75)))
  dare = read(tmp_path, 'merge_method: dare_ties\nparameters: {lambda: 0.5}\n' + two)
  assert (dare.settings['p'], dare.weights, dare.scale) == (pytest.approx(0.7), (0.25, 0.75),
                                                            0.5)
  della = read(tmp_path, 'merge_method: della\nparameters: {epsilon: 0.1}\n' + two)
  assert (della.settings['density'], della.settings['epsilon']) == (0.3, 0.1)
  crumbs = read(tmp_path, 'merge_method: breadcrumbs_ties\nparameters: {gamma: 0.05}\n' + two)
  assert (crumbs.settings['top'], crumbs.settings['bottom'],
          crumbs.settings['density']) == (0.05, 0.0, 0.3)


def test_dare_ties_sums_the_agreeing_deltas_without_normalizing(tmp_path):
  """mergekit's dare_ties does not divide by the agreeing weights (normalize defaults to false
  for it, unlike ties): at density 1, θ0 + Σ_t a_t w_t τ_t, checked in numpy."""
  base, models = fixture(str(tmp_path))
  weights = (0.5, 1.5)
  config = merge_checkpoints_config.get_config()
  config.mergekit = mergekit_yaml(
      tmp_path / 'merge.yaml', f'merge_method: dare_ties\nbase_model: {base}\nmodels:\n' +
      ''.join(f'  - {{model: {m}, parameters: {{weight: {w}}}}}\n'
              for m, w in zip(models, weights)))
  config.output = str(tmp_path / 'out')
  checkpoints.run(config, str(tmp_path))
  out = reference.read_output(config.output)
  theta0 = reference.read_output(base)
  thetas = [reference.read_output(m) for m in models[:2]]
  w = np.asarray(weights)[:, None]
  for n, x0 in theta0.items():
    weighted = w * np.stack([t[n] - x0 for t in thetas]).reshape(2, -1).astype(np.float64)
    sign = np.where(weighted.sum(0) >= 0, 1.0, -1.0)
    agree = (np.sign(weighted) == sign) & (weighted != 0)
    np.testing.assert_allclose(out[n], x0 + (weighted * agree).sum(0).reshape(x0.shape),
                               rtol=1e-5, atol=1e-6, err_msg=n)


def test_a_parameter_mergekit_ignores_is_accepted_with_a_warning(tmp_path, caplog):
  base, models = fixture(str(tmp_path))
  text = (f'merge_method: task_arithmetic\nbase_model: {base}\n'
          f'models: [{{model: {models[0]}, parameters: {{weight: 1.0, density: 0.5}}}}]\n')
  with caplog.at_level(logging.WARNING):
    config = read(tmp_path, text + 'parameters: {int8_mask: true, t: 0.3}\n')
  warned = [r.getMessage() for r in caplog.records if 'is ignored' in r.getMessage()]
  assert any('models[0].parameters.density is ignored' in m for m in warned), warned
  assert any('parameters.t is ignored' in m for m in warned), warned
  assert config.method == 'task_arithmetic' and config.settings['normalize'] is False


def test_spherical_recipes_without_a_base_interpolate_the_models_weights(tmp_path):
  base, models = fixture(str(tmp_path))
  listed = f'models: [{{model: {models[0]}}}, {{model: {models[1]}}}]\n'
  nuslerp = read(tmp_path, 'merge_method: nuslerp\n' + listed)
  # The first model is the origin of the task vectors; the weights are interpolated.
  assert (nuslerp.base, nuslerp.models) == (models[0], (models[0], models[1]))
  assert nuslerp.settings['task_space'] is False
  with_base = read(tmp_path, f'merge_method: nuslerp\nbase_model: {base}\n' + listed)
  assert (with_base.base, with_base.settings['task_space']) == (base, True)
  # mergekit's Karcher mean averages every model it is given, the base model too.
  karcher = read(tmp_path, f'merge_method: karcher\nbase_model: {base}\n' + listed)
  assert karcher.models == (base, models[0], models[1])


def test_the_output_card_records_the_merge_and_its_recipe(tmp_path):
  base, models = fixture(str(tmp_path))
  text = (f'merge_method: slerp\nbase_model: {base}\nparameters: {{t: 0.25}}\n'
          f'models: [{{model: {base}}}, {{model: {models[2]}}}]\n')
  config = merge_checkpoints_config.get_config()
  config.mergekit = mergekit_yaml(tmp_path / 'merge.yaml', text)
  config.output = str(tmp_path / 'out')
  checkpoints.run(config, str(tmp_path))
  with open(os.path.join(config.output, 'README.md')) as f:
    card = f.read()
  assert '- method: `slerp`' in card and '"t": 0.25' in card and models[2] in card
  assert text.rstrip() in card


def test_a_gradient_interpolates_over_the_layers_and_a_filter_picks_by_name():
  gradient = [0, 0.5, 0.3, 0.7, 1]
  # t = 2/3: s = 2.667, between 0.3 and 0.7.
  assert layered.resolve(gradient, 'x', 2 / 3) == pytest.approx(0.3 + (2 / 3 * 4 - 2) * 0.4)
  assert layered.resolve(gradient, 'x', 1.0) == 1 and layered.resolve(gradient, 'x', 0) == 0
  assert layered.resolve([True, False], 'x', 0.9) is True  # flags are picked, not mixed
  spec = [{'filter': 'self_attn', 'value': gradient}, {'filter': 'mlp', 'value': 0.2},
          {'value': 0.5}]
  assert layered.resolve(spec, 'model.layers.3.self_attn.q_proj.weight', 0.25) == 0.5
  assert layered.resolve(spec, 'model.layers.3.mlp.up_proj.weight', 0.25) == 0.2
  assert layered.resolve(spec, 'model.norm.weight', 0.0) == 0.5
  assert layered.resolve(spec[:1], 'model.norm.weight', 0.0) is None
  names = ['model.embed_tokens.weight', 'model.layers.0.mlp.w', 'model.layers.1.mlp.w',
           'model.layers.2.mlp.w', 'lm_head.weight']
  assert layered.positions(names) == dict(zip(names, [0.0, 0.0, 0.5, 1.0, 0.0]))


GRADIENT_SLERP = '''
models:
  - model: {base}
  - model: {models[0]}
merge_method: slerp
base_model: {base}
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5 # fallback for rest of tensors
dtype: float32
'''


FOUR_LAYERS = dict(hidden=16, layers=4, vocab=32, mlp=32, kv=16)


def merged_by_recipe(tmp_path, template: str, **fields):
  """The merge of mergekit YAML `template` (formatted with the 4-layer fixture's `base` and
  `models` and `fields`) through the launch job: its output's, the base's and the models'
  tensors."""
  base, models = checkpoint_benchmark.make_fixture(str(tmp_path / 'models'), FOUR_LAYERS)
  config = merge_checkpoints_config.get_config()
  config.mergekit = mergekit_yaml(tmp_path / 'merge.yaml',
                                  template.format(base=base, models=models, **fields))
  config.output = str(tmp_path / 'out')
  checkpoints.run(config, str(tmp_path))
  return (reference.read_output(config.output), reference.read_output(base),
          [reference.read_output(m) for m in models])


def test_mergekits_gradient_slerp_example_runs_unchanged(tmp_path):
  """examples/gradient-slerp.yml (with local models, its `models:` form) on a 4-layer model:
  each tensor slerped at its own t, checked against numpy."""
  out, theta0, (theta1, *_) = merged_by_recipe(tmp_path, GRADIENT_SLERP)
  attention, mlp = np.array([0, 0.5, 0.3, 0.7, 1]), np.array([1, 0.5, 0.7, 0.3, 0])
  for n, x0 in theta0.items():
    layer = int(n.split('.')[2]) if n.startswith('model.layers.') else None
    position = 0.0 if layer is None else layer / 3
    if 'self_attn' in n or 'mlp' in n:
      t = np.interp(position, np.linspace(0, 1, 5), attention if 'self_attn' in n else mlp)
    else:
      t = 0.5
    np.testing.assert_allclose(out[n], references.slerp(t, x0, theta1[n]), rtol=1e-5,
                               atol=1e-6, err_msg=n)


@pytest.mark.parametrize('layered_value, message', [
    ('{"t": [0, "x"]}', r"config.layered.t = 'x': must be a number in \[0, 1\]"),
    ('{"t": [{"filter": "mlp"}]}', r'config.layered.t\[0\] = .*a \{filter, value\} entry'),
    ('{"t": [0, 2]}', r'config.layered.t = 2.* in \[0, 1\]'),
    ('{"density": [0.1, 0.5]}', 'slerp has no setting'),
    ('[1, 2]', r'a mapping \{field: value\}'),
])
def test_bad_layered_values_are_named(tmp_path, layered_value, message):
  base, models = fixture(str(tmp_path))
  config = merge_checkpoints_config.get_config()
  config.update(base=base, models=models[0], method='slerp', layered=layered_value,
                output=str(tmp_path / 'out'))
  with pytest.raises(UserError, match=message):
    checkpoints.run(config, str(tmp_path))
  assert not os.path.exists(tmp_path / 'out')


TIES_EXAMPLE = '''
models:
  - model: {models[0]}
    parameters:
      density: [1, 0.7, 0.1] # density gradient
      weight: 1.0
  - model: {models[1]}
    parameters:
      density: 0.5
      weight: [0, 0.3, 0.7, 1] # weight gradient
  - model: {models[2]}
    parameters:
      density: 0.33
      weight:
        - filter: mlp
          value: 0.5
        - value: 0
merge_method: ties
base_model: {base}
parameters:
  normalize: true
  int8_mask: true
dtype: float32
'''


def test_mergekits_ties_example_runs_unchanged(tmp_path):
  """examples/ties.yml (local models): per-model densities, a density and a weight gradient
  and a weight per module, checked against numpy with mergekit's TIES, tensor by tensor."""
  shape = dict(hidden=16, layers=4, vocab=32, mlp=32, kv=16)
  base, models = checkpoint_benchmark.make_fixture(str(tmp_path / 'models'), shape)
  config = merge_checkpoints_config.get_config()
  config.mergekit = mergekit_yaml(tmp_path / 'merge.yaml',
                                  TIES_EXAMPLE.format(base=base, models=models))
  config.output = str(tmp_path / 'out')
  checkpoints.run(config, str(tmp_path))
  out, theta0 = reference.read_output(config.output), reference.read_output(base)
  thetas = [reference.read_output(m) for m in models]
  for n, x0 in theta0.items():
    t = int(n.split('.')[2]) / 3 if n.startswith('model.layers.') else 0.0
    densities = [np.interp(t, [0, 0.5, 1], [1, 0.7, 0.1]), 0.5, 0.33]
    weights = [1.0, np.interp(t, np.linspace(0, 1, 4), [0, 0.3, 0.7, 1]),
               0.5 if 'mlp' in n else 0.0]
    trimmed = []
    for theta, density in zip(thetas, densities):
      delta = (theta[n].astype(np.float64) - x0).ravel()
      if density < 1:  # mergekit's magnitude: the ⌊d·n⌋ largest, ties to the earlier
        keep = np.argsort(-np.abs(delta), kind='stable')[:int(density * delta.size)]
        delta = np.where(np.isin(np.arange(delta.size), keep), delta, 0)
      trimmed.append(delta)
    w = np.asarray(weights)[:, None]
    weighted = w * np.stack(trimmed)
    sign = np.where(weighted.sum(0) >= 0, 1, -1)
    agree = (np.sign(weighted) == sign) & (weighted != 0)
    divisor = (agree * w).sum(0)
    merged = (weighted * agree).sum(0) / np.where(divisor == 0, 1, divisor)
    np.testing.assert_allclose(out[n], x0 + merged.reshape(x0.shape), rtol=1e-5, atol=1e-6,
                               err_msg=n)


FRANKENMERGE = '''
slices:
  - sources:
    - model: {a}
      layer_range: [0, 3]
  - sources:
    - model: {b}
      layer_range: [1, 4]
merge_method: passthrough
parameters:
  scale:
    - filter: o_proj
      value: [1, 0]
    - value: 1
dtype: float32
'''


def test_a_passthrough_of_slices_stacks_and_renumbers_the_layers(tmp_path):
  """examples/orcamini-platy-44layer.yml's form on 4-layer models, with a scale per module
  and layer: layers 0-2 of a then 1-3 of b as layers 0-5, embeddings from a, the final norm
  and the head from b; the output loads in transformers as a 6-layer Llama."""
  shape = dict(hidden=16, layers=4, vocab=32, mlp=32, kv=16)
  base, models = checkpoint_benchmark.make_fixture(str(tmp_path / 'models'), shape)
  a, b = models[0], models[1]
  config = merge_checkpoints_config.get_config()
  config.mergekit = mergekit_yaml(tmp_path / 'merge.yaml', FRANKENMERGE.format(a=a, b=b))
  config.output = str(tmp_path / 'out')
  summary = checkpoints.run(config, str(tmp_path))
  assert summary['layers'] == 6
  out, ta, tb = (reference.read_output(p) for p in (config.output, a, b))
  for layer, (source, j) in enumerate([(ta, 0), (ta, 1), (ta, 2), (tb, 1), (tb, 2), (tb, 3)]):
    for suffix in ('self_attn.q_proj.weight', 'self_attn.o_proj.weight', 'mlp.up_proj.weight'):
      scale = 1 - layer / 5 if 'o_proj' in suffix else 1.0  # the gradient [1, 0] over 6 layers
      np.testing.assert_allclose(out[f'model.layers.{layer}.{suffix}'],
                                 scale * source[f'model.layers.{j}.{suffix}'], rtol=1e-6,
                                 err_msg=f'{layer} {suffix}')
  np.testing.assert_array_equal(out['model.embed_tokens.weight'], ta['model.embed_tokens.weight'])
  np.testing.assert_array_equal(out['lm_head.weight'], tb['lm_head.weight'])
  np.testing.assert_array_equal(out['model.norm.weight'], tb['model.norm.weight'])
  assert len([n for n in out if n.startswith('model.layers.')]) == 6 * 9
  transformers = pytest.importorskip('transformers')
  model = transformers.LlamaForCausalLM.from_pretrained(config.output)
  assert model.config.num_hidden_layers == 6


@pytest.mark.parametrize('span, message', [
    ('[2, 6]', r'slices\[1\]: .* has layers 0 … 3; the layer_range \[2, 6\) is not among them'),
    ('[0, 1.5]', r'slices\[1\].sources\[0\].layer_range = \[0, 1.5\]'),
])
def test_slices_outside_the_models_layers_are_refused(tmp_path, span, message):
  assert_recipe_refused(tmp_path, lambda base, models: FRANKENMERGE.format(
      a=models[0], b=models[1]).replace('[1, 4]', span), message)


def assert_recipe_refused(tmp_path, text_of, message):
  """The recipe text_of(base, models) over the 4-layer fixture is refused with `message`, and
  nothing is written."""
  base, models = checkpoint_benchmark.make_fixture(str(tmp_path / 'models'), FOUR_LAYERS)
  config = merge_checkpoints_config.get_config()
  config.mergekit = mergekit_yaml(tmp_path / 'merge.yaml', text_of(base, models))
  config.output = str(tmp_path / 'out')
  with pytest.raises(UserError, match=message):
    checkpoints.run(config, str(tmp_path))
  assert not os.path.exists(config.output) and not os.path.exists(config.output + '.partial')


SLICED_TIES = '''
slices:
  - sources:
    - model: {base}
      layer_range: [0, 2]
    - model: {a}
      layer_range: [2, 4]
    - model: {b}
      layer_range: [0, 2]
  - sources:
    - model: {base}
      layer_range: [3, 4]
    - model: {a}
      layer_range: [0, 1]
    - model: {b}
      layer_range: [1, 2]
merge_method: ties
base_model: {base}
parameters: {{density: 0.5, weight: 1.0}}
dtype: float32
'''


def renamed(model: str, ranges: list[tuple[int, int]], directory: str) -> str:
  """`model` with the layers of `ranges` stacked and renumbered, every other tensor its own,
  written by hand as a checkpoint of its own."""
  tensors = reference.read_output(model)
  layer_of = lambda n: int(n.split('.')[2]) if n.startswith('model.layers.') else None
  out = {n: x for n, x in tensors.items() if layer_of(n) is None}
  sources = [layer for first, end in ranges for layer in range(first, end)]
  for new, old in enumerate(sources):
    for n, x in tensors.items():
      if layer_of(n) == old:
        out[n.replace(f'model.layers.{old}.', f'model.layers.{new}.')] = x
  hf.save(directory, out, {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'},
          shard_bytes=2**30)
  return directory


def test_slices_merged_with_a_method_equal_the_merge_of_the_stacked_layers(tmp_path):
  """mergekit's slices with TIES: output layers 0-1 merge layers 0-1 of the base, 2-3 of a and
  0-1 of b; layer 2 merges layers 3, 0 and 1. The same bits as TIES over checkpoints that
  hold those layers renumbered, and config.json counts 3 layers."""
  shape = dict(hidden=16, layers=4, vocab=32, mlp=32, kv=16)
  base, models = checkpoint_benchmark.make_fixture(str(tmp_path / 'models'), shape)
  a, b = models[:2]
  config = merge_checkpoints_config.get_config()
  config.mergekit = mergekit_yaml(tmp_path / 'merge.yaml', SLICED_TIES.format(base=base, a=a,
                                                                              b=b))
  config.output = str(tmp_path / 'out')
  checkpoints.run(config, str(tmp_path))
  stacked = [renamed(m, ranges, str(tmp_path / f'stacked{i}')) for i, (m, ranges) in enumerate(
      [(base, [(0, 2), (3, 4)]), (a, [(2, 4), (0, 1)]), (b, [(0, 2), (1, 2)])])]
  plan = checkpoints.Plan('ties', {'density': 0.5, 'scope': 'tensor', 'normalize': True},
                          weights=(1.0, 1.0))
  checkpoints.merge(stacked[0], stacked[1:], str(tmp_path / 'expected'), plan)
  out, expected = (reference.read_output(p) for p in (config.output, str(tmp_path / 'expected')))
  assert out.keys() == expected.keys()
  for n, x in expected.items():
    np.testing.assert_array_equal(bits(out[n]), bits(x), err_msg=n)
  with open(os.path.join(config.output, 'config.json')) as f:
    assert json.load(f)['num_hidden_layers'] == 3


GRADIENT_SLERP_SLICES = '''
slices:
  - sources:
    - model: {base}
      layer_range: [0, 2]
    - model: {models[0]}
      layer_range: [0, 2]
  - sources:
    - model: {base}
      layer_range: [1, 4]
    - model: {models[0]}
      layer_range: [1, 4]
merge_method: slerp
base_model: {base}
parameters:
  t:
    - filter: self_attn
      value: [0, 1]
    - value: 0.5
dtype: float32
'''


def test_a_gradient_over_slices_runs_over_each_slices_own_layers(tmp_path):
  """examples/gradient-slerp.yml's slices form, in two slices of 2 and 3 layers: t of the
  attention goes 0, 1 over the first and 0, 0.5, 1 over the second, as mergekit plans it."""
  out, theta0, (theta1, *_) = merged_by_recipe(tmp_path, GRADIENT_SLERP_SLICES)
  sources, attention_t = [0, 1, 1, 2, 3], [0, 1, 0, 0.5, 1]
  for layer, (source, t) in enumerate(zip(sources, attention_t)):
    for suffix in ('self_attn.q_proj.weight', 'mlp.up_proj.weight'):
      name, given = f'model.layers.{layer}.{suffix}', f'model.layers.{source}.{suffix}'
      expected = references.slerp(t if 'self_attn' in suffix else 0.5, theta0[given],
                                  theta1[given])
      np.testing.assert_allclose(out[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)
  np.testing.assert_allclose(out['lm_head.weight'], references.slerp(
      0.5, theta0['lm_head.weight'], theta1['lm_head.weight']), rtol=1e-5, atol=1e-6)
  assert len([n for n in out if n.startswith('model.layers.')]) == 5 * 9


@pytest.mark.parametrize('change, message', [
    (lambda t: t.replace('[1, 2]', '[1, 3]'), r'slices\[1\]: its ranges hold \[1, 2\] layers'),
    (lambda t: t.replace('[3, 4]', '[3, 5]').replace('[0, 1]', '[0, 2]').replace('[1, 2]',
                                                                                '[1, 3]'),
     r'slices\[1\]: .* has layers 0 … 3; the layer_range \[3, 5\) is not among them'),
    (lambda t: t.replace('base_model: {base}', 'base_model: {c}'),
     'base_model .* is not a source of the slices'),
    (lambda t: t.rsplit('- model: {b}', 1)[0] + '- model: {c}' + t.rsplit('- model: {b}', 1)[1],
     r'slices\[1\] merges .*every slice merges the same models'),
    (lambda t: t.replace('layer_range: [2, 4]', 'layer_range: [2, 4]\n      parameters: '
                         '{{density: 0.3}}', 1).replace(
        'layer_range: [0, 1]', 'layer_range: [0, 1]\n      parameters: {{density: 0.4}}', 1),
     r'slices\[1\].sources\[1\].parameters: .* other parameters in an earlier slice'),
])
def test_bad_slices_are_named_and_nothing_is_written(tmp_path, change, message):
  assert_recipe_refused(tmp_path, lambda base, models: change(SLICED_TIES).format(
      base=base, a=models[0], b=models[1], c=models[2]), message)


@pytest.mark.parametrize('slices, message', [
    ('[{"BASE": [0, 2]}', r'config.slices = .* is not YAML'),
    ('{"BASE": [0, 2]}', r'a list of \{model: \[first layer, end layer\]\}'),
    ('[{"BASE": [0, 2]}]', r'config.slices\[0\]: give the base and each model of .* one layer '
                           'range'),
    ('[{"BASE": [0, 2], "A": [0, "2"]}]', r'config.slices\[0\].* = \[0, .2.\]: a layer range'),
])
def test_bad_slices_from_the_flags_are_named(tmp_path, slices, message):
  shape = dict(hidden=16, layers=4, vocab=32, mlp=32, kv=16)
  base, models = checkpoint_benchmark.make_fixture(str(tmp_path / 'models'), shape)
  config = merge_checkpoints_config.get_config()
  config.update(base=base, models=models[0], method='ties', output=str(tmp_path / 'out'),
                slices=slices.replace('BASE', base).replace('"A"', json.dumps(models[0])))
  with pytest.raises(UserError, match=message):
    checkpoints.run(config, str(tmp_path))
  assert not os.path.exists(config.output) and not os.path.exists(config.output + '.partial')


BREADCRUMBS_GRADIENT = '''
models:
  - model: {models[0]}
  - model: {models[1]}
merge_method: breadcrumbs
base_model: {base}
parameters: {{weight: 1.0, density: {density}, gamma: 0.05}}
dtype: float32
'''


def test_breadcrumbs_density_may_vary_by_layer(tmp_path):
  """density [0.2, 0.6] over 4 layers: each layer's tensors are those of the merge at that
  layer's density, 0.2 + 0.4·ℓ/3 (and 0.2 outside the layers, at t = 0)."""
  out, _, _ = merged_by_recipe(tmp_path / 'gradient', BREADCRUMBS_GRADIENT, density='[0.2, 0.6]')
  at = [merged_by_recipe(tmp_path / f'layer{layer}', BREADCRUMBS_GRADIENT,
                         density=0.2 + 0.4 * layer / 3)[0] for layer in range(4)]
  for layer, at_layer in enumerate(at):
    for n, x in at_layer.items():
      if f'layers.{layer}.' in n or (layer == 0 and 'layers.' not in n):
        np.testing.assert_allclose(out[n], x, rtol=0, atol=1e-7, err_msg=n)
  last = 'model.layers.3.mlp.up_proj.weight'
  assert np.abs(at[3][last] - at[0][last]).max() > 1e-4  # the densities keep other entries


@pytest.mark.parametrize('parameters, message', [
    ('{weight: 1.0, density: [0.2, 0.6], gamma: [0.01, 0.02, 0.03]}',
     'gradients of different lengths'),
    ('{weight: 1.0, density: [{filter: mlp, value: 0.3}, {value: 0.5}]}',
     'per-module filters of it are not supported'),
])
def test_breadcrumbs_bands_that_cannot_vary_by_layer_are_named(tmp_path, parameters, message):
  text = BREADCRUMBS_GRADIENT.replace('{{weight: 1.0, density: {density}, gamma: 0.05}}',
                                      parameters.replace('{', '{{').replace('}', '}}'))
  assert_recipe_refused(tmp_path, lambda base, models: text.format(base=base, models=models),
                        message)


def test_the_checkpoint_benchmark_holds_each_case_against_the_floor_of_its_inputs(tmp_path):
  config = quickstart.get_config('tiny')
  config.benchmark.recipes = 'slerp,passthrough'
  summary = checkpoint_benchmark.run(config, str(tmp_path), FOUR_LAYERS, runs=1)
  results = summary['results']
  assert set(results) == {'floor_1', 'slerp', 'passthrough'}  # one fine-tune: floor_1 alone
  for name in ('slerp', 'passthrough'):
    assert results[name]['floor_ratio'] == pytest.approx(
        results[name]['seconds'] / results['floor_1']['seconds'])
  assert summary['largest_tensor_bytes'] == 32 * 16 * 4  # the token table, float32
  for name in results:  # each output removed once measured
    assert not (tmp_path / 'checkpoint_merged' / name).exists(), name
  config.benchmark.recipes = 'slerp,ties_global'
  with pytest.raises(UserError, match=r"\['ties_global'\] are not checkpoint benchmark cases"):
    checkpoint_benchmark.run(config, str(tmp_path), FOUR_LAYERS)
  # A randomized case brings its exact one; a sketch as wide as these 16 × 16 matrices is the
  # exact SVD, so the two adapters agree to float32 rounding.
  config.benchmark.recipes = 'extract_lora_randomized'
  results = checkpoint_benchmark.run(config, str(tmp_path), FOUR_LAYERS, runs=1)['results']
  assert set(results) == {'floor_1', 'extract_lora', 'extract_lora_randomized'}
  assert 'error' not in results['extract_lora'] and results['extract_lora_randomized']['error'] < 1e-5


def test_the_1b_fixture_has_llama_3_2_1bs_parameters_and_a_small_one_its_dtype_and_tied_head(
    tmp_path):
  """1,235,814,400: Llama-3.2-1B's published parameter count (its head tied to its table)."""
  shapes = checkpoint_benchmark.fixture_shapes(checkpoint_benchmark.FIXTURES['llama_1b'])
  assert sum(math.prod(s) for s in shapes.values()) == 1_235_814_400
  small = dict(FOUR_LAYERS, tied=True, dtype='bfloat16', head=8)
  base, models = checkpoint_benchmark.make_fixture(str(tmp_path / 'models'), small)
  for path in [base] + models:
    model = hf.Checkpoint(path)
    assert 'lm_head.weight' not in model.files and model.config['tie_word_embeddings']
    assert model.config['num_attention_heads'] == 2
    assert {model.header(n)[1] for n in model.files} == {np.dtype(ml_dtypes.bfloat16)}
  delta = (hf.Checkpoint(models[0]).tensor('model.norm.weight').astype(np.float32) -
           hf.Checkpoint(base).tensor('model.norm.weight').astype(np.float32))
  assert 0 < np.abs(delta).max() < 0.01  # a fine-tune's small change, seen through bfloat16


def test_the_benchmarks_error_is_each_outputs_change_against_the_exact_ones(tmp_path):
  """Checkpoints: ‖Δ − Δ*‖/‖Δ*‖ of their changes from the base over all tensors; adapters:
  of their products B A, whatever factors hold them."""
  config = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}
  base = {'a': np.zeros((2, 2), np.float32), 'b': np.ones(3, np.float32)}
  exact = {'a': np.array([[3, 0], [0, 0]], np.float32), 'b': np.ones(3, np.float32)}
  near = {'a': np.array([[3, 0], [0, 0]], np.float32), 'b': np.array([1, 1, 5], np.float32)}
  for name, tensors in (('base', base), ('exact', exact), ('near', near)):
    hf.save(str(tmp_path / name), tensors, config, shard_bytes=10**9)
  error = checkpoint_benchmark.relative_error(str(tmp_path / 'near'), str(tmp_path / 'exact'),
                                              str(tmp_path / 'base'))
  assert error == pytest.approx(4 / 3)
  rng = np.random.default_rng(0)
  b, a = rng.normal(size=(5, 2)), rng.normal(size=(2, 4))
  turn = np.array([[0.0, -1.0], [1.0, 0.0]])  # B R and Rᵀ A: other factors, the same product
  key = 'base_model.model.model.layers.0.self_attn.q_proj.'
  for name, (b_i, a_i) in (('one', (b, a)), ('other', (b @ turn, turn.T @ a))):
    os.makedirs(tmp_path / name)
    safetensors.numpy.save_file({key + 'lora_B.weight': b_i.astype(np.float32),
                                 key + 'lora_A.weight': a_i.astype(np.float32)},
                                str(tmp_path / name / 'adapter_model.safetensors'))
  assert checkpoint_benchmark.relative_error(str(tmp_path / 'other'), str(tmp_path / 'one'),
                                             str(tmp_path / 'base')) < 1e-6
