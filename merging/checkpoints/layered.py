"""Values that vary by tensor, as mergekit's recipes give them: per layer (a gradient) and per
module (a filter).

A value `spec` is one of
  - a scalar: the same for every tensor;
  - a list of scalars, a gradient: at t ∈ [0, 1], with s = t·(n − 1), the interpolation
    (1 − (s − ⌊s⌋))·v[⌊s⌋] + (s − ⌊s⌋)·v[⌊s⌋ + 1] of numbers, v[⌊s⌋] of flags;
  - a list of {filter, value} entries: the value (a scalar or a gradient) of the first entry
    whose filter is a substring of the tensor's name (or is absent or '*').

t is a tensor's layer i of L as i/(L − 1) (1 for a single layer); a tensor outside the
layers (embeddings, the final norm, the head) has t = 0, as mergekit plans them. A tensor's
layer is the first `.<number>.` of its name (model.layers.7.mlp..., encoder.layer.7...).
"""

import re
from typing import Any, Callable, Iterator, Sequence

from editing.errors import UserError

_LAYER = re.compile(r'\.(\d+)\.')


def layer_of(name: str) -> int | None:
  match = _LAYER.search(name)
  return int(match.group(1)) if match else None


def positions(names: Sequence[str]) -> dict[str, float]:
  """{name: t} of every tensor."""
  layers = sorted({layer_of(n) for n in names} - {None})
  index = {layer: i for i, layer in enumerate(layers)}
  last = max(len(layers) - 1, 0)
  return {n: 0.0 if layer_of(n) is None else (index[layer_of(n)] / last if last else 1.0)
          for n in names}


def is_scalar(value: Any) -> bool:
  return isinstance(value, (bool, int, float, str))


def resolve(spec: Any, name: str, t: float) -> Any:
  """The value of `spec` for the tensor `name` at position t; None where no filter matches."""
  if is_scalar(spec):
    return spec
  if all(is_scalar(v) for v in spec):
    scaled = t * (len(spec) - 1)
    low = int(scaled)
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in spec):
      return spec[low]
    high, frac = min(len(spec) - 1, low + 1), scaled - low
    return (1 - frac) * spec[low] + frac * spec[high]
  for entry in spec:
    if entry.get('filter') in (None, '*') or entry['filter'] in name:
      return resolve(entry['value'], name, t)
  return None


def map_values(spec: Any, fn: Callable[[Any], Any]) -> Any:
  """`spec` with fn applied to each value it names (its structure kept)."""
  if is_scalar(spec):
    return fn(spec)
  if all(is_scalar(v) for v in spec):
    return [fn(v) for v in spec]
  return [{**entry, 'value': map_values(entry['value'], fn)} for entry in spec]


def anchors(spec: Any) -> Iterator[Any]:
  """Every value `spec` names: checked, they bound every value it resolves to (an interval
  holds the interpolations of its points)."""
  if is_scalar(spec):
    yield spec
  elif all(is_scalar(v) for v in spec):
    yield from spec
  else:
    for entry in spec:
      yield from anchors(entry['value'])


def check(spec: Any, where: str) -> None:
  """One clear error unless `spec` is a scalar, a non-empty gradient, or {filter, value}
  entries of those."""
  if is_scalar(spec):
    return
  if not isinstance(spec, list) or not spec:
    raise UserError(f'{where} = {spec!r}: a value, a list of values (a gradient) or a list of '
                    '{filter, value} entries')
  if all(is_scalar(v) for v in spec):
    return
  for i, entry in enumerate(spec):
    if (not isinstance(entry, dict) or 'value' not in entry or set(entry) - {'filter', 'value'}
        or not isinstance(entry.get('filter'), (str, type(None)))):
      raise UserError(f'{where}[{i}] = {entry!r}: a {{filter, value}} entry (filter a substring '
                      "of tensor names, or '*')")
    value = entry['value']
    if not (is_scalar(value) or isinstance(value, list) and value and
            all(is_scalar(v) for v in value)):
      raise UserError(f'{where}[{i}].value = {value!r}: a value or a gradient')
