"""Settings are declared once, beside their method: defaults, ranges and docs come from there."""

import functools
import math

import numpy as np
import pytest

import merging
from configs import merge as merge_config
from configs import merge_checkpoints as merge_checkpoints_config
from editing import regimes
from editing import settings
from editing.data import triggers
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import evaluate as evaluate_job
from editing.jobs import finetune as finetune_job
from editing.jobs import pretrain as pretrain_job
from editing.jobs import quickstart as quickstart_job
from editing.regimes import talos
from editing.task_vector import TaskVector
from merging import dare
from merging import ties
from merging.jobs import merge as merge_job


@settings.declare(
    rate=settings.number(0.5, '(0, 1]', 'a rate'),
    count=settings.integer(2, '[1, inf)', 'a count'),
    mode=settings.choice('a', ('a', 'b'), 'a mode'),
    constraint=settings.Constraint(lambda s: s['rate'] * s['count'] <= 2, 'rate·count ≤ 2'))
def example(x, *, rate, count, mode, key=None):
  return x, rate, count, mode, key


def test_left_out_settings_take_their_declared_defaults():
  assert example(1) == (1, 0.5, 2, 'a', None)
  assert example(1, count=3, key='k') == (1, 0.5, 3, 'a', 'k')


@pytest.mark.parametrize('given, message', [
    (dict(rate=0.0), r'test_settings.rate = 0.0: must be a number in \(0, 1\]'),
    (dict(rate=float('nan')), r'test_settings.rate = nan: must be a number in \(0, 1\]'),
    (dict(rate='0.5'), r"test_settings.rate = '0.5': must be a number"),
    (dict(count=1.5), r'test_settings.count = 1.5: must be an integer in \[1, inf\)'),
    (dict(count=True), r'test_settings.count = True: must be an integer'),
    (dict(mode='c'), r"test_settings.mode = 'c': must be one of \['a', 'b'\]"),
    (dict(rate=1.0, count=3), r'test_settings.rate = 1.0, test_settings.count = 3: rate·count ≤ 2'),
])
def test_a_value_outside_its_declaration_is_refused_naming_it(given, message):
  with pytest.raises(UserError, match=message):
    example(1, **given)


def test_an_integer_stands_for_a_number_and_becomes_a_float():
  assert settings.check(example, {'rate': 1}, 'config.example') == \
      {'rate': 1.0, 'count': 2, 'mode': 'a'}
  assert isinstance(example(0, rate=1)[1], float)


@pytest.mark.parametrize('interval, value, allowed', [
    ('[0, 1)', 0.0, True), ('[0, 1)', 1.0, False), ('(0, 1]', 0.0, False), ('(0, 1]', 1.0, True),
    ('(-inf, inf)', -1e300, True), ('[0, inf)', float('inf'), False), ('[1, 2]', 1.5, True)])
def test_interval_ends_are_open_or_closed_as_written(interval, value, allowed):
  setting = settings.Setting(None, 'a number', float, interval=interval)
  if allowed:
    assert setting.check(value, 'x') == value
  else:
    with pytest.raises(UserError, match=rf'x = {value!r}: must be a number in'):
      setting.check(value, 'x')


def test_a_declared_name_must_be_a_keyword_only_parameter():
  with pytest.raises(TypeError, match="declares 'rate'"):
    settings.declare(rate=settings.number(0.5, '(0, 1]', ''))(lambda x, rate=0.5: x)


def test_internal_arguments_are_not_settings():
  for name, method in merging.REGISTRY.items():
    assert not {'keep', 'key', 'weights', 'theta0', 'data', 'apply_fn', 'trigger',
                'masks'} & set(method.settings), name
  assert set(merging.get('ties').settings) == {'density', 'scope', 'normalize'}
  with pytest.raises(UserError, match=r'config.ties.keep is not a setting; the settings: '
                                      r"\['density', 'normalize', 'scope'\]"):
    merging.check_settings('ties', {'keep': 'foo'}, 'config.ties')


def test_a_partial_binds_its_settings_out_of_the_config():
  assert 'granularity' not in merging.get('adamerging_layer').settings
  assert merging.get('adamerging_layer').merge.keywords == {'granularity': 'layer'}
  assert set(merging.get('dam_shared').settings) == set(merging.get('dam').settings)


def test_a_merge_config_leaves_settings_unset_for_the_declarations_to_fill_in():
  config = merge_config.get_config()
  for name, method in merging.REGISTRY.items():
    section = method.section or name
    assert set(config[section]) == set(method.settings), section
    given = {'adamerging_task': {'steps': 200}, 'adamerging_layer': {'steps': 200}}.get(section, {})
    assert {k: v for k, v in config[section].items() if v is not None} == given, section
    swept = merge_job.swept(config, name)
    expected = {**{k: s.default for k, s in method.settings.items()}, **given}
    for point in merge_job.hyperparameter_grid(config, name):
      assert {k: v for k, v in point.items() if k not in swept} == \
          {k: v for k, v in expected.items() if k not in swept}, name
  checkpoint_config = merge_checkpoints_config.get_config()
  assert checkpoint_config.ties.density == ties.merge.settings['density'].default == 0.2
  assert checkpoint_config.ties.scope == 'tensor' != ties.merge.settings['scope'].default


def test_dare_shares_ties_declarations_of_what_it_passes_on():
  assert dare.merge.settings['density'] is ties.merge.settings['density']
  assert dare.merge.settings['scope'] is ties.merge.settings['scope']


def test_a_sweep_is_written_apart_from_the_values():
  config = merge_config.get_config()
  config.ties.scope = 'tensor'
  config.sweep.ties.density = (0.1, 0.3)
  config.sweep.ties.normalize = (True, False)
  grid = merge_job.hyperparameter_grid(config, 'ties')
  assert grid == [{'density': d, 'scope': 'tensor', 'normalize': n}
                  for d in (0.1, 0.3) for n in (True, False)]
  assert merge_job.swept(config, 'ties') == ['density', 'normalize']
  assert merge_job.hyperparameter_grid(config, 'task_arithmetic') == [{'normalize': False}]
  assert merge_job.hyperparameter_grid(config, 'dam_shared') == \
      merge_job.hyperparameter_grid(config, 'dam')


def test_a_setting_given_a_value_and_an_axis_is_refused_in_one_line_naming_both():
  config = merge_config.get_config()
  assert config.sweep.ties.density == (0.1, 0.2)
  config.ties.density = 0.2  # TIES' declared default, typed in: still a value given
  with pytest.raises(UserError) as raised:
    merge_job.hyperparameter_grid(config, 'ties')
  assert str(raised.value) == ('config.ties.density = 0.2 and config.sweep.ties.density = '
                               '(0.1, 0.2) both set it; give one')
  config.sweep.ties.density = None
  assert merge_job.hyperparameter_grid(config, 'ties') == [
      {'density': 0.2, 'scope': 'global', 'normalize': True}]


def test_a_result_records_every_setting_of_the_method_and_its_grid_apart():
  config = merge_config.get_config()
  config.ties.scope = 'tensor'
  used = merge_job.settings_used(config, 'ties')
  assert used['method'] == {'scope': 'tensor', 'normalize': True}
  assert used['sweep'] == {'density': [0.1, 0.2]}


@pytest.mark.parametrize('axis, message', [
    ((), r'config.sweep.ties.density is an empty grid'),
    ((0.1, '0.2'), r"config.sweep.ties.density = '0.2': must be a number in \(0, 1\]"),
    ((0.1, 1.5), r'config.sweep.ties.density = 1.5: must be a number in \(0, 1\]'),
])
def test_every_value_of_a_sweep_is_checked(axis, message):
  config = merge_config.get_config()
  config.sweep.ties.density = axis
  with pytest.raises(UserError, match=message):
    merge_job.hyperparameter_grid(config, 'ties')


def test_a_merge_called_from_python_checks_its_settings_too():
  vector = TaskVector({'w': np.ones((2, 3), np.float32)}, ('a',), 'full', 'base')
  with pytest.raises(UserError, match=r'ties.density = 1.5: must be a number in \(0, 1\]'):
    ties.merge([vector], density=1.5)
  with pytest.raises(UserError, match=r'breadcrumbs.top = 0.5, breadcrumbs.bottom = 0.6'):
    merging.get('breadcrumbs').merge([vector], top=0.5, bottom=0.6)
  merged = functools.partial(ties.merge, density=1.0)([vector, vector]).delta['w']
  assert math.isclose(float(merged.sum()), 6.0)


def test_dam_takes_no_refit_steps_and_keeps_its_initial_lambda():
  from merging import adamerging  # pylint: disable=g-import-not-at-top
  from merging import common  # pylint: disable=g-import-not-at-top
  from merging import dam  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  theta0 = {'w': np.ones((3, 2), np.float32)}
  vector = TaskVector({'w': np.full((3, 2), 0.5, np.float32)}, ('a',), 'full', 'base')
  data = {'a': common.TaskData(lambda p, x: x @ p['w'], np.ones((4, 3), np.float32))}
  learned = dam.learn([vector], theta0=theta0, data=data, key=jax.random.PRNGKey(0), masks=(),
                      refit_steps=0, init=0.25)
  np.testing.assert_array_equal(learned.coefficients, jnp.full((1,), 0.25))
  with pytest.raises(UserError, match=r'adamerging.steps = 0: must be an integer in \[1, inf\)'):
    adamerging.learn([vector], theta0=theta0, data=data, key=jax.random.PRNGKey(0), steps=0)


SECTIONS = {**quickstart_job.SECTIONS, **merge_job.SECTIONS}


@pytest.mark.parametrize('key, value, message', [
    ('talos.keep', 1.5, r'config.talos.keep = 1.5: must be a number in (0, 1]'),
    ('l_lora.rank', 0, r'config.l_lora.rank = 0: must be an integer in [1, inf)'),
    ('blended.ratio', -0.5, r'config.blended.ratio = -0.5: must be a number in [0, 1]'),
    ('poison.rate', 1.5, r'config.poison.rate = 1.5: must be a number in [0, 1]'),
    ('finetune.warmup_steps', -1, r'config.finetune.warmup_steps = -1: must be an integer in '
                                  r'[0, inf)'),
    ('pretrain.corpus', 'words', r"config.pretrain.corpus = 'words': must be one of "
                                 r"['captions', 'shapes', 'mixture']"),
    ('eval.alpha_step', 0.0, r'config.eval.alpha_step = 0.0: must be a number in (0, 1]'),
    ('merge.train_examples', 0, r'config.merge.train_examples = 0: must be an integer in '
                                r'[1, inf)'),
])
def test_a_section_s_values_are_checked_against_its_owner_s_declaration(key, value, message):
  config = merge_config.get_config()
  section, name = key.split('.')
  config[section][name] = value
  with pytest.raises(UserError) as raised:
    checks.validate(config, SECTIONS)
  assert str(raised.value) == message


def test_a_range_is_declared_once_beside_its_owner(monkeypatch):
  """Narrowing a declaration narrows what a config and a call from python accept alike."""
  config = merge_config.get_config()
  config.talos.keep = config.poison.rate = 0.5
  checks.validate(config, SECTIONS)
  monkeypatch.setitem(talos.Talos.settings, 'keep', settings.number(0.1, '(0, 0.25]', 'k'))
  monkeypatch.setitem(triggers.POISON, 'rate', settings.number(0.1, '[0, 0.25]', 'rate'))
  with pytest.raises(UserError, match=r'^config.talos.keep = 0.5: must be a number in '
                                      r'\(0, 0.25\]$'):
    checks.validate(config, SECTIONS)
  with pytest.raises(UserError, match=r'^talos.keep = 0.5: must be a number in \(0, 0.25\]$'):
    regimes.get('talos', {'keep': 0.5})
  config.talos.keep = 0.25
  with pytest.raises(UserError, match=r'^config.poison.rate = 0.5: must be a number in '
                                      r'\[0, 0.25\]$'):
    checks.validate(config, SECTIONS)


def test_configs_take_the_defaults_their_owners_declare():
  config = merge_config.get_config()
  assert dict(config.talos) == {k: s.default for k, s in talos.Talos.settings.items()}
  assert dict(config.poison) == {k: s.default for k, s in triggers.POISON.items()}
  assert dict(config.eval) == {k: s.default for k, s in evaluate_job.EVAL.items()}
  assert set(config.finetune) == set(finetune_job.TRAINING)
  assert set(config.pretrain) == set(pretrain_job.PRETRAIN)
