"""What a sparsifying method keeps of each task vector, declared as data: the in-memory merges
read it here (`kept`), and a streamed checkpoint merge (`merging.checkpoints`) reads the same
declaration a block at a time, so that each method's sparsification is written once.

A method declares, beside its merge function, `sparsity(**settings) -> Sparsity`: what it
keeps of one task vector, given that vector's settings (its own where they are given per
vector; every other setting is passed too, and a declaration ignores those it does not read).
A `Sparsity` is, applied in this order,

  draw  per-entry random drops (`Draw`): entry i of a leaf is kept with probability 1 − p
        (or, with a spread, a probability set by its magnitude's rank in its row: DELLA),
        drawn from the leaf's key (`ops.vector_key`, `ops.leaf_key`, `ops.kept_entries`),
        and the kept ones are rescaled by 1/(1 − p), or to the leaf's L1 norm
        ‖τ‖₁/‖m ⊙ τ‖₁ (`ops.RESCALES`);
  cut   a ranked mask (`Cut`) of the magnitudes of what the draw left (τ̃; τ without a draw):
        the keep(n) largest of a leaf's n entries, less its drop(n) largest, ranked per leaf
        or over the whole vector (scope 'global'), ties to the earlier entry.

The merge function takes what a streamed merge found beforehand as keyword arguments: `keep`,
each vector's masks of its cut (a pytree of booleans per vector), and `dropped`, each vector's
τ̃ after its draw; without them it finds them itself, from the same declaration.

A method may instead keep what all its vectors share by a score of each entry across them
(SCE's variances, Arcee Fusion's importances): it declares `scores(**settings) -> Scores`, and
its merge takes the mask a streamed merge found as `selected`.
"""

from typing import Any, Callable, NamedTuple

import jax

from editing import tree as tree_lib

PyTree = Any
Count = Callable[[int], int]  # n entries ↦ how many of them


class Cut(NamedTuple):
  """The keep(n) largest magnitudes of n, less the drop(n) largest of them (none without
  `drop`), per leaf (scope 'tensor') or over the whole vector ('global')."""

  keep: Count
  drop: Count | None = None
  scope: str = 'tensor'

  @property
  def counts(self) -> tuple[Count, ...]:
    """The counts to rank: the kept, then the dropped."""
    return (self.keep,) if self.drop is None else (self.keep, self.drop)


class Draw(NamedTuple):
  """Each entry dropped with probability p, the kept ones rescaled (`ops.RESCALES`); with a
  `spread` ε, entry i kept with MagPrune's q_i, 1 − p − ε to 1 − p + ε by its magnitude's rank
  in its row (`ops.rank_spread`), and rescaled by 1/q_i."""

  p: float
  rescale: str = 'probability'
  spread: float = 0.0

  @property
  def rows(self) -> bool:
    """Whether an entry's draw reads its whole row (a streamed block must hold whole rows)."""
    return self.p != 0 and self.spread != 0

  @property
  def norms(self) -> bool:
    """Whether the rescale reads the leaf's L1 norms, a sum over the whole leaf."""
    return self.rescale == 'l1_norm'


class Sparsity(NamedTuple):
  """What a method keeps of one task vector: a draw, then a cut of what it left."""

  draw: Draw | None = None
  cut: Cut | None = None


class Scores(NamedTuple):
  """A selection the vectors share, by a score of each entry across them, in one of two ways:
  the kept(n') largest of a tensor's scores (n' of them non-zero; ties to the earlier entry:
  SCE), or every score at or above threshold(values), the values being the k-th largest for
  each k of ranks(n) (Arcee Fusion's quartiles).

  score(theta0, deltas, row) computes them on the host from θ0's and each vector's entries
  (float32 numpy arrays, flat: a tensor's, or a block of its whole rows of `row` entries where
  `rows`), each entry's from its own values or its row's: a streamed merge scores a tensor a
  block at a time, ranks the scores with the one ranking engine (`editing.cuts`) and keeps
  what the merge of the whole tensor keeps. Where the scores read a value of each row that
  costs more than the rest (Arcee Fusion's divergence), `per_row(theta0, deltas, row)` gives
  those values and score(theta0, deltas, row, values) takes them: a streamed merge computes
  them in its first pass over a tensor and keeps them (one number a row) for the others."""

  score: Callable[..., Any]
  kept: Callable[[int], int] | None = None
  ranks: Callable[[int], list[int]] | None = None
  threshold: Callable[[list[float]], float] | None = None
  rows: bool = False
  per_row: Callable[[Any, list, int], Any] | None = None


def largest(density: float, scope: str = 'tensor') -> Cut:
  """The max(1, ⌊density·n⌋) largest, as mergekit counts them."""
  return Cut(lambda n: max(1, int(density * n)), scope=scope)


def band(top: float, bottom: float) -> Cut:
  """Per leaf, the n − ⌊bottom·n⌋ not among the smallest, less the ⌊top·n⌋ largest."""
  return Cut(lambda n: n - int(bottom * n), lambda n: int(top * n))


def outliers(density: float, top: float) -> Cut:
  """Per leaf, the ⌊density·n⌋ largest after its ⌊top·n⌋ largest, fewer of those where the two
  exceed n (mergekit's magnitude outliers, which count the lower edge so)."""
  kept = lambda n: int(density * n)
  not_smallest = lambda n: min(n, kept(n) + int(top * n))
  return Cut(not_smallest, lambda n: not_smallest(n) - kept(n))


def kept(delta: PyTree, cut: Cut) -> PyTree:
  """The boolean masks `cut` keeps of the deltas' magnitudes, exactly its counts."""
  # The builtin abs keeps numpy leaves numpy, which top_k ranks on the host without a compile.
  magnitudes = jax.tree.map(abs, delta)
  masks = tree_lib.top_k(magnitudes, cut.keep, cut.scope)
  if cut.drop is None:
    return masks
  # One ranking for both counts (ties to the earlier entry), so the dropped largest are a
  # subset of the kept and exactly the band between them remains.
  return jax.tree.map(lambda keep, drop: keep & ~drop, masks,
                      tree_lib.top_k(magnitudes, cut.drop, cut.scope))
