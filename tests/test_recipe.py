"""One typed Recipe of a merge (merging/recipe.py): the flags and a mergekit YAML of the same
merge build equal Recipes, its plan is the merge's, and mistakes in either are named before
anything is read or written."""

import os

import pytest

from configs import merge_checkpoints as merge_checkpoints_config
from editing.errors import UserError
from merging import checkpoints
from merging.recipe import Recipe


@pytest.fixture
def paths(tmp_path):
  """Directories standing for a base and three fine-tuned models: a recipe reads no tensor."""
  names = ['base', 'a', 'b', 'c']
  for name in names:
    os.makedirs(tmp_path / name)
  return {name: str(tmp_path / name) for name in names}


def from_yaml(tmp_path, text: str) -> Recipe:
  path = tmp_path / 'merge.yaml'
  path.write_text(text)
  return Recipe.from_mergekit(str(path))


def flags(**values):
  config = merge_checkpoints_config.get_config()
  for key, value in values.items():
    section, _, field = key.partition('__')
    if field:
      config[section][field] = value
    else:
      config[key] = value
  return config


# The same merge as a mergekit YAML and as flags: {name: (YAML, flags)}, formatted with paths.
SAME_MERGES = {
    'ties: per-model density, a density gradient, weights and λ': ('''
merge_method: ties
base_model: {base}
parameters: {{lambda: 0.8}}
models:
  - model: {a}
    parameters: {{weight: 0.6, density: 0.2}}
  - model: {b}
    parameters: {{weight: 0.4, density: [0.3, 0.7]}}
dtype: bfloat16
''', dict(method='ties', base='{base}', models='{a},{b}', weights='0.6,0.4', scale=0.8,
          dtype='bfloat16', per_model='{{density: [0.2, 1.0]}}',
          layered='{{density.1: [0.3, 0.7]}}', ties__normalize=True, ties__density=1.0)),
    'slerp: t by module and layer': ('''
merge_method: slerp
base_model: {base}
parameters:
  t: [{{filter: self_attn, value: [0, 0.5, 1]}}, {{value: 0.5}}]
models: [{{model: {base}}}, {{model: {a}}}]
''', dict(method='slerp', base='{base}', models='{a}',
          layered='{{t: [{{filter: self_attn, value: [0, 0.5, 1]}}, {{value: 0.5}}]}}')),
    'dare_linear: density as the drop probability, a weight gradient': ('''
merge_method: dare_linear
base_model: {base}
models:
  - model: {a}
    parameters: {{weight: [0, 1], density: 0.25}}
  - model: {b}
    parameters: {{weight: 2, density: 0.25}}
''', dict(method='dare', base='{base}', models='{a},{b}', weights='1,2',
          layered='{{weights.0: [0, 1]}}', dare__then='task_arithmetic', dare__p=0.75,
          dare__normalize=False, dare__rescale='l1_norm')),
    'breadcrumbs_ties: density and gamma as a band': ('''
merge_method: breadcrumbs_ties
base_model: {base}
parameters: {{density: 0.5, gamma: 0.1}}
models: [{{model: {a}, parameters: {{weight: 1.0}}}}, {{model: {b}, parameters: {{weight: 0.5}}}}]
''', dict(method='breadcrumbs', base='{base}', models='{a},{b}', weights='1.0,0.5',
          breadcrumbs__top=0.1, breadcrumbs__bottom=0.0, breadcrumbs__density=0.5,
          breadcrumbs__elect_sign=True,
          breadcrumbs__normalize=False)),
    'model_stock: filter-wise': ('''
merge_method: model_stock
base_model: {base}
parameters: {{filter_wise: true}}
models: [{{model: {a}}}, {{model: {b}}}, {{model: {c}}}]
''', dict(method='model_stock', base='{base}', models='{a},{b},{c}',
          model_stock__clip=False, model_stock__filter_wise=True)),
    'ties over slices': ('''
merge_method: ties
base_model: {base}
parameters: {{density: 0.5, weight: 1.0}}
slices:
  - sources:
    - {{model: {base}, layer_range: [0, 2]}}
    - {{model: {a}, layer_range: [2, 4]}}
''', dict(method='ties', base='{base}', models='{a}', weights='1.0', ties__density=0.5,
          slices='[{{{base}: [0, 2], {a}: [2, 4]}}]')),
    'passthrough with a scale per module': ('''
merge_method: passthrough
parameters: {{scale: [{{filter: o_proj, value: [1, 0]}}, {{value: 1}}]}}
slices:
  - sources: [{{model: {a}, layer_range: [0, 3]}}]
  - sources: [{{model: {b}, layer_range: [1, 4]}}]
''', dict(method='passthrough', slices='[{{{a}: [0, 3]}}, {{{b}: [1, 4]}}]',
          layered='{{scale: [{{filter: o_proj, value: [1, 0]}}, {{value: 1}}]}}')),
}


@pytest.mark.parametrize('name', sorted(SAME_MERGES))
def test_the_flags_and_the_yaml_of_one_merge_build_equal_recipes(tmp_path, paths, name):
  text, given = SAME_MERGES[name]
  from_flags = Recipe.from_flags(flags(**{
      k: v.format(**paths) if isinstance(v, str) else v for k, v in given.items()}))
  assert from_yaml(tmp_path, text.format(**paths)) == from_flags


def test_the_recipe_plans_the_merge_it_describes(tmp_path, paths):
  text = SAME_MERGES['ties: per-model density, a density gradient, weights and λ'][0]
  plan = from_yaml(tmp_path, text.format(**paths)).plan()
  assert plan == checkpoints.Plan(
      'ties', {'density': 1.0, 'normalize': True, 'scope': 'tensor'}, scale=0.8,
      weights=(0.6, 0.4), dtype='bfloat16', per_model=(('density', (0.2, 1.0)),),
      layered=(('density.1', [0.3, 0.7]),))


def test_a_yaml_recipe_takes_its_output_options_from_the_flags(tmp_path, paths):
  path = tmp_path / 'merge.yaml'
  path.write_text(f'merge_method: slerp\nbase_model: {paths["base"]}\nparameters: {{t: 0.5}}\n'
                  f'models: [{{model: {paths["a"]}}}]\n')
  config = flags(seed=7, output='/out', overwrite=True, shard_bytes=1000, method='ties')
  recipe = Recipe.from_mergekit(str(path), config)
  assert (recipe.method, recipe.seed, recipe.output, recipe.overwrite, recipe.shard_bytes) == (
      'slerp', 7, '/out', True, 1000)
  assert recipe.mergekit_yaml == path.read_text()


@pytest.mark.parametrize('given, message', [
    (dict(per_model='{density: 0.2}'), r'config.per_model = .*: a mapping \{setting: \[one'),
    (dict(layered='[1, 2]'), r'config.layered = .*: a mapping \{field: value\}'),
    (dict(layered='{t: [0, 1}'), r'config.layered = .* is not YAML'),
    (dict(slices='{x: [0, 2]}'), r'config.slices = .*: a list of \{model: \[first layer'),
    (dict(weights='1,x'), r"config.weights = '1,x': comma-separated numbers"),
    (dict(weights='1,-1', task_arithmetic__normalize=True),
     r"config.weights = '1,-1' sum to 0, and task_arithmetic with normalize divides"),
    (dict(base=''), 'config.base: give the base checkpoint'),
    (dict(method='passthrough'), 'config.slices: passthrough stacks slices'),
])
def test_bad_flags_are_named(paths, given, message):
  values = dict(method='task_arithmetic', base=paths['base'], models=f'{paths["a"]},'
                f'{paths["b"]}')
  with pytest.raises(UserError, match=message):
    Recipe.from_flags(flags(**{**values, **given}))


def refused(tmp_path, text, message):
  """The YAML `text` is refused by the merge job with `message`, nothing written."""
  config = merge_checkpoints_config.get_config()
  (tmp_path / 'merge.yaml').write_text(text)
  config.update(mergekit=str(tmp_path / 'merge.yaml'), output=str(tmp_path / 'out'))
  before = sorted(os.listdir(tmp_path))
  with pytest.raises(UserError, match=message):
    checkpoints.run(config, str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == before


def test_a_model_listed_twice_is_refused_as_mergekit_refuses_it(tmp_path, paths):
  os.symlink(paths['a'], tmp_path / 'a_again')
  yaml_path = tmp_path / 'merge.yaml'
  head = f'merge_method: ties\nbase_model: {paths["base"]}\nmodels:\n  - model: {paths["a"]}\n'
  refused(tmp_path, head + f'  - model: {paths["a"]}\n',
          rf'{yaml_path}: models lists {paths["a"]} twice; mergekit refuses duplicate')
  refused(tmp_path, head + f'  - model: {tmp_path / "a_again"}\n',
          rf'models lists {tmp_path / "a_again"} twice \(as {paths["a"]}, the same directory\)')
  refused(tmp_path, f'merge_method: ties\nbase_model: {paths["base"]}\nslices:\n  - sources:\n'
          + ''.join(f'    - {{model: {m}, layer_range: [0, 1]}}\n'
                    for m in (paths['base'], paths['a'], paths['a'])),
          r'slices\[0\].sources lists .*/a twice')


def test_linear_weights_that_sum_to_zero_are_refused_before_anything_runs(tmp_path, paths):
  refused(tmp_path, f'merge_method: linear\nmodels:\n'
          f'  - {{model: {paths["a"]}, parameters: {{weight: 1.0}}}}\n'
          f'  - {{model: {paths["b"]}, parameters: {{weight: -1.0}}}}\n',
          r'merge.yaml: parameters.weight of the models sum to 0 \(\[1.0, -1.0\]\); linear '
          'divides by their sum')
