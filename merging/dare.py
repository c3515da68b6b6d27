"""DARE: drop a share p of every task vector's entries at random and rescale the rest, then
merge with task arithmetic or TIES.

Yu et al., "Language Models are Super Mario: Absorbing Abilities from Homologous Models as a
Free Lunch", ICML 2024:

  τ̃_t = (1 − m_t) ⊙ τ_t / (1 − p),   m_t ~ Bernoulli(p) per entry.

Peers draw the masks from a global RNG, so their result depends on the order of the vectors and
of the parameters. Here task t's leaf at `path` draws from
fold_in(fold_in(key, stable_hash(task)), stable_hash(path)), entry i from fold_in of that with i
(`ops.kept_entries`). What holds, exactly:
- each dropped vector τ̃_t is the same bits whatever the order of the vectors, the order of the
  leaves, the device count, the sharding or the blocks a streamed merge reads (it depends only
  on the key, its tasks and paths);
- the merge of the same vectors in the same order is the same bits on any device count
  (tested on 1 and 8);
- reordering the vectors changes only the float summation order of the merge: the same value
  up to rounding, not necessarily the same bits.
p = 0 is the base merge exactly.

The paper rescales the kept entries by 1/(1 − p); mergekit (since 2024) instead scales each
tensor's kept entries to the tensor's L1 norm, ‖τ‖₁/‖m ⊙ τ‖₁ (`rescale='l1_norm'`, what its
YAML recipes get here).
"""

from typing import Any, Mapping, Sequence

import jax

from editing import settings
from editing.task_vector import TaskVector, check_compatible
from merging import common
from merging import ops
from merging import sparsity as sparsity_lib
from merging import task_arithmetic
from merging import ties

BASE_MERGES = ('task_arithmetic', 'ties')


def drop(task_vectors: Sequence[TaskVector], ps: Sequence[float], key: jax.Array,
         rescale: str = 'probability') -> list[TaskVector]:
  """τ̃_t for every vector (vector t dropped with probability ps[t]), each keyed by its
  tasks' names."""
  return [v.replace(delta=ops.drop_and_rescale(v.delta, p, ops.vector_key(key, v.tasks), rescale))
          for v, p in zip(task_vectors, ps)]


def sparsity(*, p: float, rescale: str, then: str, density: float, scope: str,
             **_) -> sparsity_lib.Sparsity:
  """What DARE keeps of one vector: each entry with probability 1 − p, rescaled (`drop`);
  before TIES below density 1, then TIES' cut of the dropped τ̃ (at 1 it keeps every entry)."""
  cut = (ties.sparsity(density=density, scope=scope).cut if then == 'ties' and density < 1
         else None)
  return sparsity_lib.Sparsity(draw=sparsity_lib.Draw(p, rescale), cut=cut)


@settings.declare(
    p=settings.number(0.5, '[0, 1)', 'the drop probability'),
    rescale=settings.choice('probability', ops.RESCALES, "the kept entries' rescale: by "
                            "1/(1 − p) (the paper) or to each tensor's L1 norm (mergekit)"),
    then=settings.choice('task_arithmetic', BASE_MERGES, 'the merge of the dropped vectors'),
    density=ties.merge.settings['density'],
    scope=ties.merge.settings['scope'],
    normalize=settings.flag(None, "divide by the (agreeing) weights; None: `then`'s default"))
def merge(task_vectors: Sequence[TaskVector], *, key: jax.Array, p: float, rescale: str,
          then: str,
          density: float, scope: str, normalize: bool | None,
          weights: Sequence[float] | None = None, per_vector: Mapping[str, Sequence] | None = None,
          keep: Sequence[Any] | None = None,
          dropped: Sequence[Any] | None = None) -> TaskVector:
  """DARE followed by `then` (TIES reads density and scope), with its `weights` and
  `normalize` (None: `then`'s default); `per_vector` may give each vector its own p (and
  TIES' density: mergekit's per-model density); `keep`, TIES' masks of the dropped vectors
  ranked beforehand (see `ties.trim`); `dropped`, each vector's τ̃ drawn beforehand (a
  streamed block's, whose draws and L1 norms are its whole tensor's)."""
  check_compatible(task_vectors, 'dare')
  own = common.per_vector(per_vector, {'p': p, 'density': density}, len(task_vectors), merge,
                          'dare')
  if dropped is None:
    dropped = drop(task_vectors, [s['p'] for s in own], key, rescale)
  else:
    dropped = [v.replace(delta=d) for v, d in zip(task_vectors, dropped)]
  options = {'weights': weights, **({} if normalize is None else {'normalize': normalize})}
  if then == 'task_arithmetic':
    return task_arithmetic.merge(dropped, **options)
  densities = {'density': [s['density'] for s in own]} if per_vector else None
  return ties.merge(dropped, density=density, scope=scope, keep=keep, per_vector=densities,
                    **options)
