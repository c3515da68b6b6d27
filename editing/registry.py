"""Named registries: regimes, triggers and merging methods are looked up by their config name.

Entries that take settings are frozen dataclasses; their settings (a config section) replace
fields, and a key that is not a field is named in the error.
"""

import dataclasses
from typing import Any, Mapping, TypeVar

from editing.errors import UserError

T = TypeVar('T')


def lookup(registry: Mapping[str, T], name: str, kind: str) -> T:
  """registry[name], or an error naming the known entries."""
  try:
    return registry[name]
  except KeyError:
    raise UserError(f'unknown {kind} {name!r}; known: {sorted(registry)}') from None


def configured(registry: Mapping[str, T], name: str, kind: str,
               settings: Mapping[str, Any] | None = None, *, fixed: tuple[str, ...] = ()) -> T:
  """The dataclass entry `name` with `settings` replacing its fields (not those in `fixed`)."""
  entry = lookup(registry, name, kind)
  if not settings:
    return entry
  fields = {f.name for f in dataclasses.fields(entry)} - set(fixed)
  unknown = sorted(set(settings) - fields)
  if unknown:
    raise UserError(f'{name}.{unknown[0]} is not a setting of the {kind} {name}; settings: '
                     f'{sorted(fields)}')
  return dataclasses.replace(entry, **settings)
