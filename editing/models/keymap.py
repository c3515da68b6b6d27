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

from typing import Callable, NamedTuple, Sequence

import numpy as np

Rule = tuple[str, str, str]


class _Layout(NamedTuple):
  to_ours: Callable[[np.ndarray, int], np.ndarray]  # (their array, heads) -> ours
  to_theirs: Callable[[np.ndarray], np.ndarray]  # our array -> theirs
  their_shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # of our shape


_LAYOUTS = {
    'copy': _Layout(lambda x, h: x, lambda x: x, lambda s: s),
    'linear': _Layout(lambda x, h: x.T, lambda x: x.T, lambda s: s[::-1]),
    'conv': _Layout(lambda x, h: x.transpose(2, 3, 1, 0), lambda x: x.transpose(3, 2, 0, 1),
                    lambda s: (s[3], s[2], s[0], s[1])),
    'heads_in': _Layout(lambda x, h: x.T.reshape(x.shape[1], h, -1),
                        lambda x: x.reshape(x.shape[0], -1).T, lambda s: (s[1] * s[2], s[0])),
    'heads_bias': _Layout(lambda x, h: x.reshape(h, -1), lambda x: x.reshape(-1),
                          lambda s: (s[0] * s[1],)),
    'heads_out': _Layout(lambda x, h: x.T.reshape(h, -1, x.shape[0]),
                         lambda x: x.reshape(-1, x.shape[-1]).T, lambda s: (s[2], s[0] * s[1])),
    'lead1': _Layout(lambda x, h: x.reshape(x.shape[1:]), lambda x: x.reshape((1,) + x.shape),
                     lambda s: (1,) + s),
    'lead2': _Layout(lambda x, h: x.reshape(x.shape[2:]),
                     lambda x: x.reshape((1, 1) + x.shape), lambda s: (1, 1) + s),
}


def _parts(layout: str) -> tuple[_Layout, int, int]:
  """(the layout proper, the part k, the number of parts n) of 'layout@k/n' (n = 1 without)."""
  base, k, n = layout, 0, 1
  if '@' in layout:
    base, part = layout.split('@')
    k, n = (int(i) for i in part.split('/'))
  if base not in _LAYOUTS:
    raise ValueError(f'unknown layout {base!r}')
  return _LAYOUTS[base], k, n


def _to_ours(layout: str, x: np.ndarray, heads: int) -> np.ndarray:
  proper, k, n = _parts(layout)
  if n > 1:
    x = np.split(x, n, axis=0)[k]
  return proper.to_ours(x, heads)


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
    proper, k, n = _parts(layout)
    parts.setdefault(theirs, {})[k] = proper.to_theirs(np.asarray(x))
    counts[theirs] = n
  incomplete = [t for t, got in parts.items() if len(got) != counts[t]]
  if incomplete:
    raise ValueError(f'parts of {incomplete} are missing')
  return {t: np.ascontiguousarray(np.concatenate([got[k] for k in range(counts[t])]))
          for t, got in parts.items()}


def their_shape(layout: str, shape: Sequence[int]) -> tuple[int, ...]:
  """The shape their tensor has for our leaf of `shape` (the whole tensor, for a part)."""
  proper, _, n = _parts(layout)
  theirs = proper.their_shape(tuple(shape))
  return (n * theirs[0],) + theirs[1:]
