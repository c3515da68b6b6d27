"""Sweeps: lists of overrides, written apart from the values they override.

A config's values stay where they are (config.ties.density); a sweep is written under
config.sweep at the same dotted key: config.sweep.ties.density = (0.1, 0.2) is an axis over
config.ties.density, and on the command line `--config.sweep.ties.density='(0.1,0.2)'`. The
points of a sweep are every combination of its axes, each a dict {dotted key: value}, the last
axis varying fastest:

  {'ties.density': (0.1, 0.2), 'ties.normalize': (True, False)}
  -> [{'ties.density': 0.1, 'ties.normalize': True},
      {'ties.density': 0.1, 'ties.normalize': False},
      {'ties.density': 0.2, 'ties.normalize': True},
      {'ties.density': 0.2, 'ties.normalize': False}]

A setting is set one way: a value and an axis for the same key are refused, naming both.
"""

import copy
import itertools
from typing import Any, Mapping, Sequence

import ml_collections

from editing.errors import UserError


def axes(config: ml_collections.ConfigDict, section: str) -> dict[str, tuple]:
  """The axes of config.sweep.<section>, {dotted key under config: values}, in the section's
  order; a key left unset (None) is no axis. An axis that is not a tuple (a comma string, a
  lone value), is empty or lists a value twice is refused naming its key."""
  found = {}
  for name, axis in _dotted(_section(config.get('sweep'), section), section).items():
    if axis is None:
      continue
    where = f'config.sweep.{name}'
    if not isinstance(axis, (tuple, list)):
      raise UserError(f'{where} = {axis!r}: an axis is a tuple of values, e.g. '
                      f"--config.sweep.{name}='(a,b)'")
    if not axis:
      raise UserError(f'{where} is an empty grid; give at least one value')
    twice = [v for i, v in enumerate(axis) if v in axis[:i]]
    if twice:
      raise UserError(f'{where} = {tuple(axis)!r} lists {twice[0]!r} twice')
    found[name] = tuple(axis)
  return found


def points(spec: Mapping[str, Sequence]) -> list[dict[str, Any]]:
  """Every combination of the axes of `spec` ({dotted key: values}), the last axis fastest;
  no axes make one point, the empty override."""
  keys = list(spec)
  return [dict(zip(keys, values)) for values in itertools.product(*spec.values())]


def refuse_value_and_axis(config: ml_collections.ConfigDict, spec: Mapping[str, Sequence],
                          sets: Mapping[str, Sequence[str]] | None = None) -> None:
  """Refuses a key that an axis of `spec` sets and that config also gives a value (not None),
  in one line naming both. An axis sets its own key, or the keys `sets` lists for it (one
  seed axis may set several seeds)."""
  for key, axis in spec.items():
    for target in (sets or {}).get(key, (key,)):
      value = value_at(config, target)
      if value is not None:
        raise UserError(f'config.{target} = {value!r} and config.sweep.{key} = '
                        f'{tuple(axis)!r} both set it; give one')


def overridden(config: ml_collections.ConfigDict,
               point: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `config` with each dotted key of `point` set to its value (config untouched)."""
  out = copy.deepcopy(config)
  for key, value in point.items():
    *parents, name = key.split('.')
    section = out
    for parent in parents:
      section = section[parent]
    section[name] = value
  return out


def value_at(config: ml_collections.ConfigDict, key: str) -> Any:
  """config's value at dotted `key`, or None where a section or the key is absent."""
  value = config
  for part in key.split('.'):
    if not hasattr(value, 'get'):
      return None
    value = value.get(part)
  return value


def _section(sweep, section: str):
  """The part of config.sweep at dotted `section` (None where there is none)."""
  for part in section.split('.'):
    if sweep is None:
      return None
    sweep = sweep.get(part)
  return sweep


def _dotted(section, prefix: str) -> dict[str, Any]:
  """{prefix.key: value} of a (nested) sweep section; a value that is no section is an axis."""
  if section is None:
    return {}
  if not hasattr(section, 'items'):
    return {prefix: section}
  out = {}
  for key, value in section.items():
    out.update(_dotted(value, f'{prefix}.{key}') if hasattr(value, 'items')
               else {f'{prefix}.{key}': value})
  return out
