"""A sweep is a list of overrides kept apart from the values: its points, its one dialect (tuples
under config.sweep), and the refusal of a setting given both a value and an axis."""

import os

import ml_collections
import pytest

from configs import safety as safety_config
from editing import sweep
from editing.errors import UserError
from merging.jobs import safety


def a_config():
  config = ml_collections.ConfigDict()
  config.ties = ml_collections.ConfigDict(dict(
      density=ml_collections.config_dict.placeholder(float),
      normalize=ml_collections.config_dict.placeholder(bool), scope='global'))
  config.sweep = ml_collections.ConfigDict()
  config.sweep.ties = ml_collections.ConfigDict(dict(
      density=ml_collections.config_dict.placeholder(tuple),
      normalize=ml_collections.config_dict.placeholder(tuple)))
  config.sweep.seed = ml_collections.config_dict.placeholder(tuple)
  return config


def test_points_are_every_combination_the_last_axis_fastest():
  assert sweep.points({'ties.density': (0.1, 0.2), 'ties.normalize': (True, False)}) == [
      {'ties.density': 0.1, 'ties.normalize': True},
      {'ties.density': 0.1, 'ties.normalize': False},
      {'ties.density': 0.2, 'ties.normalize': True},
      {'ties.density': 0.2, 'ties.normalize': False}]
  assert sweep.points({'seed': (2, 0, 1)}) == [{'seed': 2}, {'seed': 0}, {'seed': 1}]
  assert sweep.points({}) == [{}]


def test_axes_are_the_tuples_under_config_sweep_by_dotted_key():
  config = a_config()
  assert sweep.axes(config, 'ties') == {}
  config.sweep.ties.normalize = (True, False)
  config.sweep.ties.density = (0.1,)
  config.sweep.seed = (0, 1)
  assert sweep.axes(config, 'ties') == {'ties.density': (0.1,), 'ties.normalize': (True, False)}
  assert sweep.axes(config, 'seed') == {'seed': (0, 1)}
  assert sweep.axes(config, 'dare') == {}


@pytest.mark.parametrize('axis, message', [
    ((), r'^config.sweep.ties.density is an empty grid; give at least one value$'),
    ('0.1,0.2', r"^config.sweep.ties.density = '0.1,0.2': an axis is a tuple of values"),
    ((0.1, 0.2, 0.1), r'^config.sweep.ties.density = \(0.1, 0.2, 0.1\) lists 0.1 twice$'),
])
def test_an_axis_that_is_no_tuple_empty_or_repeating_is_refused_naming_its_key(axis, message):
  config = a_config()
  del config.sweep.ties['density']
  config.sweep.ties.density = axis
  with pytest.raises(UserError, match=message):
    sweep.axes(config, 'ties')


def test_a_value_and_an_axis_for_one_key_are_refused_in_one_line_naming_both():
  config = a_config()
  config.sweep.ties.density = (0.1, 0.2)
  sweep.refuse_value_and_axis(config, sweep.axes(config, 'ties'))
  config.ties.density = 0.2  # equal to a default or not, a value given is a value
  with pytest.raises(UserError) as raised:
    sweep.refuse_value_and_axis(config, sweep.axes(config, 'ties'))
  assert str(raised.value) == ('config.ties.density = 0.2 and config.sweep.ties.density = '
                               '(0.1, 0.2) both set it; give one')


def test_a_point_overrides_a_copy_of_the_config():
  config = a_config()
  point = sweep.overridden(config, {'ties.density': 0.3, 'ties.scope': 'tensor'})
  assert (point.ties.density, point.ties.scope) == (0.3, 'tensor')
  assert (config.ties.density, config.ties.scope) == (None, 'global')


def test_the_safety_seeds_are_one_axis_setting_every_seed_the_config_leaves_unset(tmp_path):
  config = safety_config.get_config('tiny')
  assert safety.seed_list(config) == [0, 1]
  config.merge.seed = 0
  with pytest.raises(UserError, match=r'^config.merge.seed = 0 and config.sweep.seed = \(0, 1\) '
                                      r'both set it; give one$'):
    safety.run(config, str(tmp_path))
  config = safety_config.get_config('tiny')
  config.safety.update(seeds='0')  # the seeds are an axis, not a comma string
  with pytest.raises(UserError, match=r'^config.safety.seeds is not a setting of the safety '
                                      r'experiment.*config.sweep.seed'):
    safety.run(config, str(tmp_path))
  assert not os.listdir(tmp_path)
