"""Plain-numpy references the tests hold the library against, written from the definitions
(the papers', mergekit's conventions) rather than from the library's code: no jax, no sort
that could share a tie-breaking bug with the code under test."""

import math
from typing import Callable, Mapping

import numpy as np


def path_order(paths) -> list[str]:
  """'/'-joined paths in the order a pytree of nested dicts is traversed: keys sorted at
  every level."""
  return sorted(paths, key=lambda p: p.split('/'))


def descending_ranks(values) -> np.ndarray:
  """Each entry's 0-based place when the entries are ordered largest first, ties to the
  earlier entry (row-major): rank_i = #{j : v_j > v_i} + #{j < i : v_j = v_i}."""
  v = np.ravel(np.asarray(values))
  index = np.arange(v.size)
  ranks = np.empty(v.size, np.int64)
  for start in range(0, v.size, 512):  # pairwise comparisons, 512 rows at a time
    rows, at = v[start:start + 512, None], index[start:start + 512, None]
    ranks[start:start + 512] = ((v[None, :] > rows).sum(axis=1) +
                                ((v[None, :] == rows) & (index[None, :] < at)).sum(axis=1))
  return ranks


def top_k(scores: Mapping[str, np.ndarray], count: Callable[[int], int],
          scope: str) -> dict[str, np.ndarray]:
  """{path: bool mask} of the count(n) highest scores, ties to the earlier entry: per leaf
  (scope='tensor', n its size), or over all leaves concatenated in path order ('global')."""
  paths = path_order(scores)
  if scope == 'tensor':
    return {p: (descending_ranks(scores[p]) < count(np.size(scores[p]))).reshape(
        np.shape(scores[p])) for p in paths}
  assert scope == 'global', scope
  values = np.concatenate([np.ravel(scores[p]) for p in paths])
  keep = descending_ranks(values) < count(values.size)
  out, start = {}, 0
  for p in paths:
    size = np.size(scores[p])
    out[p] = keep[start:start + size].reshape(np.shape(scores[p]))
    start += size
  return out


def keep_largest(delta: Mapping[str, np.ndarray], density: float,
                 scope: str) -> dict[str, np.ndarray]:
  """TIES' trim: the max(1, ⌊density·n⌋) largest |τ| (mergekit's count)."""
  return top_k({p: np.abs(d) for p, d in delta.items()},
               lambda n: max(1, math.floor(density * n)), scope)


def keep_band(delta: Mapping[str, np.ndarray], top: float,
              bottom: float) -> dict[str, np.ndarray]:
  """Breadcrumbs' band, per leaf: all but the ⌊top·n⌋ largest and the ⌊bottom·n⌋ smallest |τ|
  (one ranking, ties to the earlier entry counting as the larger)."""
  out = {}
  for p, d in delta.items():
    n = np.size(d)
    ranks = descending_ranks(np.abs(d))
    out[p] = ((ranks >= math.floor(top * n)) & (ranks < n - math.floor(bottom * n))).reshape(
        np.shape(d))
  return out


def unit(x: np.ndarray) -> np.ndarray:
  """Rows scaled to unit L2 norm."""
  x = np.asarray(x, np.float64)
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def cosine_predictions(embeddings: np.ndarray, head: np.ndarray) -> np.ndarray:
  """argmax_c cos(f(x), w_c): a frozen cosine head's class (its logit scale changes no argmax)."""
  return np.argmax(unit(embeddings) @ unit(head).T, axis=-1)


def attack_success_rate(predictions: np.ndarray, labels: np.ndarray, target: int) -> float:
  """The share of the examples whose true label is not `target` that are sent to `target`."""
  others = np.asarray(labels) != target
  return float(np.mean(np.asarray(predictions)[others] == target))


def slerp(t: float, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """mergekit's slerp of two tensors read as flat vectors (lerp where |cos Ω| > 0.9995)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  ua = a / np.linalg.norm(a) if np.linalg.norm(a) > 1e-8 else a
  ub = b / np.linalg.norm(b) if np.linalg.norm(b) > 1e-8 else b
  cos = np.sum(ua * ub)
  if abs(cos) > 0.9995:
    return (1 - t) * a + t * b
  omega = np.arccos(cos)
  return (np.sin((1 - t) * omega) * a + np.sin(t * omega) * b) / np.sin(omega)
