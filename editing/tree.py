"""Pytree paths: stable '/'-joined keys, regex leaf selection, structure checks, top-k masks,
fingerprints.

Every leaf of a params tree is named by its path, e.g. ``blocks_0/attn/query/kernel``. Selection
by path pattern (first matching rule wins, as in big_vision) is how regimes, masks and sharding
rules pick leaves, and the same names key safetensors files.
"""

import hashlib
import re
import zlib
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import cuts
from editing import distributed
from editing.errors import UserError

PyTree = Any
SCOPES = ('tensor', 'global')


def path_str(path) -> str:
  """'/'-joined name of a key path from `jax.tree_util`."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      parts.append(key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    else:
      parts.append(str(key))
  return '/'.join(parts)


def flatten(tree: PyTree) -> dict[str, Any]:
  """{path: leaf} in traversal order."""
  return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten(flat: dict[str, Any]) -> dict:
  """Nested dicts from {path: leaf}; the inverse of `flatten` for dict trees."""
  tree: dict = {}
  for path, leaf in flat.items():
    *parents, name = path.split('/')
    node = tree
    for parent in parents:
      node = node.setdefault(parent, {})
    node[name] = leaf
  return tree


def map_with_path(fn: Callable[[str, Any], Any], tree: PyTree, *rest: PyTree) -> PyTree:
  """`jax.tree.map` whose function also receives the leaf's '/'-joined path first."""
  return jax.tree_util.tree_map_with_path(lambda p, *x: fn(path_str(p), *x), tree, *rest)


def stable_hash(name: str) -> int:
  """A 31-bit hash of a path or name that is the same in every process (unlike `hash`)."""
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


def first_match(path: str, rules: Sequence[tuple[str, Any]]) -> Any:
  """The value of the first (regex, value) rule whose regex fully matches `path`."""
  for pattern, value in rules:
    if re.fullmatch(pattern, path):
      return value
  raise KeyError(f'no rule matches parameter {path!r}; rules: {[r for r, _ in rules]}')


def select(tree: PyTree, patterns: Iterable[str]) -> dict[str, bool]:
  """{path: True if some regex in `patterns` fully matches it}. Unused patterns are an error."""
  patterns = list(patterns)
  paths = list(flatten(tree))
  unused = [p for p in patterns if not any(re.fullmatch(p, path) for path in paths)]
  if unused:
    raise UserError(f'pattern(s) {unused} match no parameter; parameters look like {paths[:4]}')
  return {path: any(re.fullmatch(p, path) for p in patterns) for path in paths}


def first_mismatch(a: PyTree, b: PyTree) -> str | None:
  """The first path at which two trees differ in structure or shape; None if they agree."""
  flat_a, flat_b = flatten(a), flatten(b)
  for path in list(flat_a) + [p for p in flat_b if p not in flat_a]:
    if path not in flat_a:
      return f'{path} (only in the second tree)'
    if path not in flat_b:
      return f'{path} (only in the first tree)'
    x, y = flat_a[path], flat_b[path]
    if np.shape(x) != np.shape(y):
      return f'{path} (shape {np.shape(x)} vs {np.shape(y)})'
  return None


def check_same_structure(a: PyTree, b: PyTree, name_a: str, name_b: str) -> None:
  """An error naming the first path where `a` and `b` differ in structure or shape."""
  mismatch = first_mismatch(a, b)
  if mismatch is not None:
    raise UserError(f'{name_a} and {name_b} differ at {mismatch}')


def first_nonfinite(tree: PyTree) -> str | None:
  """The path of the first leaf holding a NaN or an infinity; None if every value is finite."""
  for path, leaf in flatten(tree).items():
    array = np.asarray(leaf)
    # bfloat16 and other ml_dtypes are not np.inexact, so test by excluding the exact kinds.
    # A finite float64 sum means every entry is finite: one pass without a mask settles the
    # usual case; only a non-finite sum (a NaN, an infinity, or float64 leaves overflowing)
    # is checked entry by entry.
    if (array.dtype.kind not in 'biu' and not np.isfinite(np.sum(array, dtype=np.float64)) and
        not np.isfinite(array).all()):
      return path
  return None


def check_finite(tree: PyTree, what: str) -> None:
  """An error naming `what` and the first leaf path holding a NaN or an infinity."""
  path = first_nonfinite(tree)
  if path is not None:
    raise UserError(f'{what}: {path} holds non-finite values (NaN or infinity)')


def top_k(scores: PyTree, count: Callable[[int], int], scope: str = 'global') -> PyTree:
  """Boolean masks, True on the `count(n)` highest of n scores, exactly.

  scope='tensor' ranks every leaf on its own (n = the leaf's size); scope='global' ranks the
  whole tree at once (n = every entry). Ties go to the earlier entry (leaf order, then
  row-major), so the count is exact whatever the values. For the lowest scores, pass −scores.
  Jit-able: `count` sees static sizes.
  """
  if scope not in SCOPES:
    raise UserError(f'scope must be one of {SCOPES}, got {scope!r}')

  leaves, treedef = jax.tree.flatten(scores)
  # Traced (under jit), XLA ranks by a sort. Concrete arrays are ranked on the host by
  # `editing.cuts`, the streamed merges' engine: no compile per shape, and faster than the sort
  # on a CPU. Either way the masks are the same bits (NaN ranking above all).
  xp = jnp if any(isinstance(s, jax.core.Tracer) for s in leaves) else np
  if xp is np:
    leaves = [distributed.to_host(s) for s in leaves]

  def top(values):
    kept = count(values.size)
    if kept <= 0 or kept >= values.size:
      return xp.full(values.shape, kept > 0)
    if xp is np:
      return cuts.cut_mask(values, cuts.largest_cut(values, kept))
    # The kept-th largest value, then every larger one and the earliest of those equal to it:
    # what a stable descending argsort keeps, for a sort of the values alone.
    threshold = jnp.sort(values)[values.size - kept]
    above, ties = values > threshold, values == threshold
    return above | (ties & (jnp.cumsum(ties) <= kept - jnp.count_nonzero(above)))

  if scope == 'tensor':
    masks = [top(xp.ravel(s)).reshape(np.shape(s)) for s in leaves]
  else:
    # jnp's promotion for mixed leaves (bfloat16 with float16 makes float32), on either path.
    dtype = jnp.result_type(*leaves)
    kept = top(xp.concatenate([xp.ravel(s).astype(dtype, copy=False) for s in leaves]))
    pieces = xp.split(kept, np.cumsum([np.size(s) for s in leaves])[:-1].tolist())
    masks = [p.reshape(np.shape(s)) for p, s in zip(pieces, leaves)]
  return jax.tree.unflatten(treedef, masks)


def fingerprint(tree: PyTree) -> str:
  """A short hex digest of paths, shapes, dtypes and values: identifies a base model."""
  digest = hashlib.sha256()
  for path, leaf in sorted(flatten(tree).items()):
    array = np.asarray(leaf)
    digest.update(f'{path}:{array.shape}:{array.dtype};'.encode())
    digest.update(np.ascontiguousarray(array).tobytes())
  return digest.hexdigest()[:16]


def num_params(tree: PyTree) -> int:
  return sum(int(np.size(leaf)) for leaf in jax.tree.leaves(tree))
