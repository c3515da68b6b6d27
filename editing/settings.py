"""Settings declared once, beside the function that takes them: a default, the values allowed
and a line of doc each, as optax factories take their hyperparameters.

  @settings.declare(
      density=settings.number(0.2, '(0, 1]', 'the share of magnitudes kept, the paper\\'s k'),
      scope=settings.choice('global', ('global', 'tensor'), 'what top-k ranks'))
  def merge(task_vectors, *, density, scope, keep=None): ...

`merge(vectors)` runs at the defaults; `merge(vectors, density=2.0)` is refused with a UserError
naming the setting and its range. The declaration is the one place a range is checked: a job
checks its config section against it (`check`, naming the config key) before it writes
anything, and a config takes its defaults from it (`defaults`), or leaves each setting unset
(`unset`) for the declaration to fill in where it is used. Arguments that are not declared
(precomputed masks, keys, data) are not settings.

Settings are declared the same way where they are not a function's: on a frozen dataclass
(`Declared`: a regime, a trigger), or as a config section's {name: Setting} beside the code
that reads it (`editing.jobs.finetune.TRAINING`, `editing.jobs.evaluate.EVAL`, ...).
"""

import dataclasses
import functools
import inspect
import math
import numbers
import re
from typing import Any, Callable, ClassVar, Mapping

import ml_collections

from editing.errors import UserError

_INTERVAL = re.compile(r'^([\[(])\s*(\S+?)\s*,\s*(\S+?)\s*([\])])$')


@dataclasses.dataclass(frozen=True)
class Setting:
  """One setting: its default, its kind, the values it allows and what it means."""

  default: Any
  doc: str
  kind: type  # bool, int, float or str
  interval: str | None = None  # '(0, 1]', '[1, inf)': the allowed numbers, in math notation
  choices: tuple | None = None  # the allowed values, for a str setting

  def __post_init__(self):
    self.check(self.default, 'the default')

  def check(self, value: Any, where: str) -> Any:
    """`value` as this setting takes it (an int given for a float becomes a float), or a
    UserError naming `where` and what the value must be. A setting whose default is None
    (something else decides) takes None too."""
    if value is None and self.default is None:
      return None
    if not self._of_kind(value):
      raise UserError(f'{where} = {value!r}: must be {self.expected}')
    if self.kind is float:
      value = float(value)
    if self.choices is not None and value not in self.choices:
      raise UserError(f'{where} = {value!r}: must be {self.expected}')
    if self.interval is not None and not _within(value, self.interval):
      raise UserError(f'{where} = {value!r}: must be {self.expected}')
    return value

  @property
  def expected(self) -> str:
    if self.choices is not None:
      return f'one of {list(self.choices)}'
    noun = {bool: 'true or false', int: 'an integer', float: 'a number', str: 'a string'}
    return noun[self.kind] + (f' in {self.interval}' if self.interval else '')

  def _of_kind(self, value: Any) -> bool:
    if self.kind is bool or isinstance(value, bool):
      return self.kind is bool and isinstance(value, bool)
    if self.kind is float:
      return isinstance(value, numbers.Real)
    if self.kind is int:
      return isinstance(value, numbers.Integral)
    return isinstance(value, self.kind)


def number(default: float, interval: str, doc: str) -> Setting:
  """A real setting within `interval`, e.g. '(0, 1]' or '[0, inf)'; a default of None means
  something else decides."""
  return Setting(None if default is None else float(default), doc, float, interval=interval)


def integer(default: int, interval: str, doc: str) -> Setting:
  """An integer setting within `interval`, e.g. '[1, inf)'."""
  return Setting(default, doc, int, interval=interval)


def choice(default: str, choices: tuple[str, ...], doc: str) -> Setting:
  return Setting(default, doc, str, choices=tuple(choices))


def flag(default: bool | None, doc: str) -> Setting:
  return Setting(default, doc, bool)


def text(default: str, doc: str) -> Setting:
  """A free string setting: names, paths, a regex."""
  return Setting(default, doc, str)


def _within(value: float, interval: str) -> bool:
  match = _INTERVAL.match(interval)
  if match is None:
    raise ValueError(f'interval {interval!r} is not of the form [low, high) or (low, high]')
  opening, low, high, closing = match.groups()
  low, high = float(low), float(high)
  if math.isnan(value):
    return False
  return ((low < value) if opening == '(' else (low <= value)) and \
         ((value < high) if closing == ')' else (value <= high))


@dataclasses.dataclass(frozen=True)
class Constraint:
  """A condition on several settings together, e.g. Breadcrumbs' top + bottom < 1."""

  holds: Callable[[Mapping[str, Any]], bool]
  says: str


def declare(constraint: Constraint | None = None, where: str | None = None, **declared: Setting):
  """Decorates a function whose keyword arguments `declared` are its settings.

  The decorated function fills in each setting left out with its default and checks every
  setting given before the body runs, an error naming `where`.<setting> (`where`: the
  function's module unless given). `fn.settings` maps each name to its `Setting`.
  """
  def decorate(fn):
    parameters = inspect.signature(fn).parameters
    forwards = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for name in declared:
      p = parameters.get(name)
      if not forwards and (p is None or p.kind is not inspect.Parameter.KEYWORD_ONLY):
        raise TypeError(f'{fn.__qualname__} declares {name!r}, not one of its keyword-only '
                        'parameters')
    owner = where or fn.__module__.rsplit('.', 1)[-1]

    @functools.wraps(fn)
    def with_settings(*args, **kwargs):
      given = {k: kwargs.pop(k) for k in list(kwargs) if k in declared}
      return fn(*args, **kwargs, **check(with_settings, given, owner))

    with_settings.settings = dict(declared)
    with_settings.constraint = constraint
    return with_settings

  return decorate


class Declared:
  """A frozen dataclass some of whose fields are settings, declared in its class attribute
  `settings` ({field: Setting}, each field's default the declaration's): every instance,
  `dataclasses.replace` too, is checked as it is made, an error naming `<name>.<field>` (its
  `name`, a field or a class attribute: the config section of its settings)."""

  settings: ClassVar[dict[str, Setting]] = {}

  def __post_init__(self):
    check(self, {k: getattr(self, k) for k in self.settings}, self.name)


def of(fn: Callable | Mapping[str, Setting]) -> dict[str, Setting]:
  """The settings `fn` declares, less those a functools.partial of it binds; a section's
  declaration ({name: Setting}) as it is."""
  if isinstance(fn, Mapping):
    return dict(fn)
  bound = fn.keywords if isinstance(fn, functools.partial) else {}
  inner = fn.func if isinstance(fn, functools.partial) else fn
  return {k: s for k, s in getattr(inner, 'settings', {}).items() if k not in bound}


def check(fn: Callable, given: Mapping[str, Any], where: str) -> dict[str, Any]:
  """Every setting of `fn`: each one in `given` checked (an error names `where`.<setting>),
  the others at their defaults (a functools.partial's bound ones left to it). A key that is
  not a setting is an error naming the settings."""
  inner = fn.func if isinstance(fn, functools.partial) else fn
  declared = of(fn)
  unknown = sorted(set(given) - set(declared))
  if unknown:
    raise UserError(f'{where}.{unknown[0]} is not a setting; the settings: {sorted(declared)}')
  values = {name: (s.check(given[name], f'{where}.{name}') if name in given else s.default)
            for name, s in declared.items()}
  constraint = getattr(inner, 'constraint', None)
  if constraint is not None and not constraint.holds(values):
    shown = ', '.join(f'{where}.{k} = {v!r}' for k, v in values.items() if k in given)
    raise UserError(f'{shown or where}: {constraint.says}')
  return values


def defaults(fn: Callable) -> ml_collections.ConfigDict:
  """A config section holding every setting of `fn` at its default (a default of None as a
  placeholder of the setting's kind, which a command line can still set)."""
  return ml_collections.ConfigDict({
      k: ml_collections.config_dict.placeholder(s.kind) if s.default is None else s.default
      for k, s in of(fn).items()})


def unset(fn: Callable) -> ml_collections.ConfigDict:
  """A config section with every setting of `fn` unset: a placeholder of the setting's kind,
  which a config or a command line may set. A setting left unset takes its declared default
  where `fn` is called, so a value given, even one equal to the default, is told apart."""
  return ml_collections.ConfigDict({k: ml_collections.config_dict.placeholder(s.kind)
                                    for k, s in of(fn).items()})


def sweep_axes(fn: Callable) -> ml_collections.ConfigDict:
  """A config section with an empty axis per setting of `fn`: a tuple given for one of them
  (`--config.sweep.ties.density='(0.1,0.2)'`) makes it a grid axis."""
  return ml_collections.ConfigDict({k: ml_collections.config_dict.placeholder(tuple)
                                    for k in of(fn)})
