"""Pytree paths: stable '/'-joined keys, regex leaf selection, structure checks, top-k masks,
fingerprints.

Every leaf of a params tree is named by its path, e.g. ``blocks_0/attn/query/kernel``. Selection
by path pattern (first matching rule wins, as in big_vision) is how regimes, masks and sharding
rules pick leaves, and the same names key safetensors files.
"""

import hashlib
import math
import re
import zlib
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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
  # Traced (under jit), XLA ranks by a sort. Concrete arrays are ranked on the host in numpy:
  # its linear selection finds the same k-th value ~25× faster on a CPU, and the masks cost
  # no compile per shape. Either way the masks are the same bits (NaN ranking above all).
  xp = jnp if any(isinstance(s, jax.core.Tracer) for s in leaves) else np
  if xp is np:
    leaves = [distributed.to_host(s) for s in leaves]

  def top(values):
    kept = count(values.size)
    if kept <= 0 or kept >= values.size:
      return xp.full(values.shape, kept > 0)
    if xp is np:
      return cut_mask(values, largest_cut(values, kept))
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


class Cut(NamedTuple):
  """A top-k mask of a 1-D array in two numbers: the entries above `threshold`, and those equal
  to it up to index `last` (ties to the earlier entry). It is evaluated on any slice of the
  array (`cut_mask`), so a tensor ranked once is masked a block at a time."""

  threshold: float
  last: int


def largest_cut(values: np.ndarray, kept: int) -> Cut:
  """The cut of the `kept` largest of a 1-D numpy array, exactly as a stable descending
  argsort keeps them (none for kept ≤ 0, every non-NaN entry for kept ≥ the size); NaN ranks
  above everything (and, comparing false, is never kept).

  Numpy's linear selection, on a large array over only the entries a sample brackets: a strided
  sample (a prime stride, so no row length aligns with it) puts two bounds a few standard
  errors either side of the kept-th largest; one pass counts the entries above the upper bound
  and collects those between the bounds, and the selection runs among those alone. Exact
  whatever the sample says: when the bounds miss (or NaNs are present), every entry is ranked.
  """
  n = values.size
  fixed = fixed_cut(n, kept)
  if fixed is not None:
    return fixed
  if n >= 1 << 20:
    lower, upper = bracket(values[::_prime_at_least(n >> 16)][:, None], n, kept)
    counted = Bracketed(0, [], [])
    # In chunks that stay in the cache, whose masks are small enough to be reused, not faulted
    # in page by page.
    for start in range(0, n, _CHUNK):
      counted = counted.add(values[start:start + _CHUNK], start, lower, upper)
      if counted is None:
        break  # NaNs: only the full ranking places them
    else:
      found = counted.cut(kept)
      if found is not None:
        return found
  threshold = np.partition(values, n - kept)[n - kept]
  return cut_at(threshold.item(), values == threshold, kept - np.count_nonzero(values > threshold))


_CHUNK = 1 << 18


def fixed_cut(n: int, kept: int) -> Cut | None:
  """The cut of the `kept` largest of n entries where it keeps none or all of them, whatever
  their values; None where it depends on them."""
  if kept <= 0:
    return Cut(math.inf, -1)
  if kept >= n:
    return Cut(-math.inf, n - 1)
  return None


def cut_at(threshold: float, equal: np.ndarray, room: int) -> Cut:
  """The cut keeping the entries above `threshold` and the first `room` of those equal to it
  (`equal`, their mask in order)."""
  ties = np.flatnonzero(equal)[:max(room, 0)]
  return Cut(threshold, int(ties[-1]) if ties.size else -1)


def bracket(sample: np.ndarray, n: int, kept: int) -> tuple[float, float]:
  """Bounds either side of where the kept-th largest of n entries lies, from a sample of them
  in clusters (one row each: entries drawn together, contiguous ones say): six standard errors
  of the sampled share above it, estimated from the clusters' spread (so a sample of unlike
  rows gets a wider bracket), and a rank for rounding."""
  m, share = sample.size, kept / n
  from_top = min(m, max(1, round(share * m)))
  estimate = np.partition(sample.ravel(), m - from_top)[m - from_top]
  per_cluster = np.mean(sample >= estimate, axis=1)
  error = max(np.std(per_cluster) / math.sqrt(per_cluster.size),
              math.sqrt(share * (1 - share) / m))
  slack = 6 * error + 2 / m
  low = math.floor((1 - share - slack) * m)
  high = math.ceil((1 - share + slack) * m)
  # A bound past the sample's ends is open: the entries beyond what the sample saw are inside.
  lower, upper = np.partition(sample.ravel(), (max(low, 0), min(high, m - 1)))[
      [max(low, 0), min(high, m - 1)]].tolist()
  return (lower if low > 0 else -math.inf), (upper if high < m - 1 else math.inf)


class Bracketed(NamedTuple):
  """What a pass over an array, a chunk at a time, found of a bracket [lower, upper]: how many
  entries lie above it, and the positions and values of those inside it."""

  above: int
  where: list
  inside: list

  def add(self, chunk: np.ndarray, start: int, lower: float, upper: float) -> 'Bracketed | None':
    """With the entries [start, start + len) of the array; None if the chunk holds a NaN."""
    not_above = chunk <= upper
    over = np.count_nonzero(chunk > upper)
    if over + np.count_nonzero(not_above) != chunk.size:
      return None
    where = np.flatnonzero(not_above & (chunk >= lower))
    return self.extend(over, where + start, chunk[where])

  def extend(self, above: int, where: np.ndarray, inside: np.ndarray) -> 'Bracketed':
    """With `above` more entries above the bracket, and more inside it."""
    return Bracketed(self.above + above, self.where + [where], self.inside + [inside])

  def join(self, later: 'Bracketed') -> 'Bracketed':
    """With what a pass over the later part of the array found."""
    return Bracketed(self.above + later.above, self.where + later.where,
                     self.inside + later.inside)

  def cut(self, kept: int) -> Cut | None:
    """The cut of the kept largest, if the kept-th largest lies inside the bracket."""
    if self.above >= kept:
      return None
    inside = np.concatenate(self.inside)
    if self.above + inside.size < kept:
      return None
    rank = inside.size - (kept - self.above)
    threshold = np.partition(inside, rank)[rank]
    # The kept-th largest is inside, so at least one entry equal to it is kept.
    cut = cut_at(threshold.item(), inside == threshold,
                 kept - self.above - np.count_nonzero(inside > threshold))
    return Cut(cut.threshold, int(np.concatenate(self.where)[cut.last]))


def _prime_at_least(k: int) -> int:
  k = max(k, 2)
  while any(k % d == 0 for d in range(2, math.isqrt(k) + 1)):
    k += 1
  return k


def cut_mask(values, cut: Cut):
  """The mask `cut` keeps of `values`: numpy on the host, or traced in jnp on a block of the
  ranked array (with `cut.last` counted from the block's first entry)."""
  above = values > cut.threshold
  if isinstance(values, np.ndarray):
    if cut.last >= 0:
      above[np.flatnonzero(values[:cut.last + 1] == cut.threshold)] = True
    return above
  return above | ((values == cut.threshold) & (jnp.arange(values.size) <= cut.last))


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
