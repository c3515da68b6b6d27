"""Renaming and re-laying tensors between an outside format and editmerge's params.

A key map is a table of rules (our path, their name, layout), `{i}` in both standing for a
block's index. A layout is a pair of exact inverses, so import → export gives back the same
bytes:

  copy        the same array
  linear      theirs (out, in)            ↔ ours (in, out)                 (PyTorch Linear)
  conv        theirs (out, in, kh, kw)    ↔ ours (kh, kw, in, out)         (PyTorch Conv2d)
  heads_in    theirs (heads·dim, in)      ↔ ours (in, heads, dim)          (q, k, v weights)
  heads_bias  theirs (heads·dim,)         ↔ ours (heads, dim)              (q, k, v biases)
  heads_out   theirs (out, heads·dim)     ↔ ours (heads, dim, out)         (the output weight)
  lead1       theirs (1, ...)             ↔ ours (...)                     (ViT's position table)
  lead2       theirs (1, 1, ...)          ↔ ours (...)                     (ViT's class token)

A layout may end in `@k/n`: their tensor packs n equal parts along its first axis and the rule
reads part k (open_clip's `in_proj_weight` holds q, k and v: `heads_in@0/3`, `@1/3`, `@2/3`).
Exporting concatenates the parts of one name in order.
"""

from typing import Callable, Sequence

import numpy as np

Rule = tuple[str, str, str]
# Layouts whose arrays differ only by leading axes of size one: how many.
_LEADING = {'lead1': 1, 'lead2': 2}


def _parts(layout: str) -> tuple[str, int, int]:
  """(the layout proper, the part k, the number of parts n) of 'layout@k/n' (n = 1 without)."""
  if '@' not in layout:
    return layout, 0, 1
  base, part = layout.split('@')
  k, n = part.split('/')
  return base, int(k), int(n)


def _to_ours(layout: str, x: np.ndarray, heads: int) -> np.ndarray:
  layout, k, n = _parts(layout)
  if n > 1:
    x = np.split(x, n, axis=0)[k]
  if layout == 'copy':
    return x
  if layout == 'linear':
    return x.T
  if layout == 'conv':
    return x.transpose(2, 3, 1, 0)
  if layout == 'heads_in':
    return x.T.reshape(x.shape[1], heads, -1)
  if layout == 'heads_bias':
    return x.reshape(heads, -1)
  if layout == 'heads_out':
    return x.T.reshape(heads, -1, x.shape[0])
  if layout in _LEADING:
    return x.reshape(x.shape[_LEADING[layout]:])
  raise ValueError(f'unknown layout {layout!r}')


def _to_theirs(layout: str, x: np.ndarray) -> np.ndarray:
  if layout == 'copy':
    return x
  if layout == 'linear':
    return x.T
  if layout == 'conv':
    return x.transpose(3, 2, 0, 1)
  if layout == 'heads_in':
    return x.reshape(x.shape[0], -1).T
  if layout == 'heads_bias':
    return x.reshape(-1)
  if layout == 'heads_out':
    return x.reshape(-1, x.shape[-1]).T
  if layout in _LEADING:
    return x.reshape((1,) * _LEADING[layout] + x.shape)
  raise ValueError(f'unknown layout {layout!r}')


def expand(rules: Sequence[Rule], depth: int) -> list[Rule]:
  """The rules with `{i}` written out for blocks 0..depth-1."""
  out = []
  for ours, theirs, layout in rules:
    indices = range(depth) if '{i}' in ours else [None]
    out.extend((ours.format(i=i), theirs.format(i=i), layout) for i in indices)
  return out


def to_ours(rules: Sequence[Rule], read: Callable[[str], np.ndarray], heads: int,
            skip: Callable[[str], bool] = lambda path: False) -> dict[str, np.ndarray]:
  """{our path: array} read through `read(their name)` for every rule whose path `skip`
  keeps; `read` raises KeyError for a name it does not have."""
  return {ours: np.ascontiguousarray(_to_ours(layout, read(theirs), heads))
          for ours, theirs, layout in rules if not skip(ours)}


def to_theirs(rules: Sequence[Rule], flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """{their name: array} from our {path: array}; every path must have a rule, and every part of
  a packed tensor a path."""
  by_path = {ours: (theirs, layout) for ours, theirs, layout in rules}
  missing = [p for p in flat if p not in by_path]
  if missing:
    raise ValueError(f'no rule maps {missing}')
  parts: dict[str, dict[int, np.ndarray]] = {}
  counts: dict[str, int] = {}
  for path, x in flat.items():
    theirs, layout = by_path[path]
    base, k, n = _parts(layout)
    parts.setdefault(theirs, {})[k] = _to_theirs(base, np.asarray(x))
    counts[theirs] = n
  incomplete = [t for t, got in parts.items() if len(got) != counts[t]]
  if incomplete:
    raise ValueError(f'parts of {incomplete} are missing')
  return {t: np.ascontiguousarray(np.concatenate([got[k] for k in range(counts[t])]))
          for t, got in parts.items()}


def their_shape(layout: str, shape: Sequence[int]) -> tuple[int, ...]:
  """The shape their tensor has for our leaf of `shape` (the whole tensor, for a part)."""
  layout, _, n = _parts(layout)
  theirs = _their_part_shape(layout, tuple(shape))
  return (n * theirs[0],) + theirs[1:]


def _their_part_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  if layout == 'copy':
    return shape
  if layout == 'linear':
    return shape[::-1]
  if layout == 'conv':
    return (shape[3], shape[2], shape[0], shape[1])
  if layout == 'heads_in':
    return (shape[1] * shape[2], shape[0])
  if layout == 'heads_bias':
    return (shape[0] * shape[1],)
  if layout == 'heads_out':
    return (shape[2], shape[0] * shape[1])
  if layout in _LEADING:
    return (1,) * _LEADING[layout] + shape
  raise ValueError(f'unknown layout {layout!r}')
