"""Task vectors: τ = θ_ft − θ0 as a pytree that knows where it came from.

A `TaskVector` holds the delta (a params-shaped pytree) and static metadata: the tasks it
encodes, the fine-tuning regime that made it, and a fingerprint of the base θ0. Metadata is
static pytree aux data, so vectors pass through `jax.jit` and `jax.tree.map`, and mismatches are
caught at trace time.

Algebra (Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023):

  τ_a + τ_b,  τ_a − τ_b,  c·τ,  −τ,  sum([τ_1, ..., τ_T]),  θ0 + α·τ  (`apply_to`).

Vectors of different regimes or bases never combine: a linearized vector only means something on
the linearized model around its own θ0.

A LoRA vector keeps its factors: its delta is {path: `editing.lora.LowRank`} over the adapted
kernels alone (every other leaf unchanged). Scaling and negation act on the scale s, a sum
stacks the factors (ranks add), and θ0 + α·τ multiplies B A out one kernel at a time; nothing
else is made dense until `materialized` is asked for.
"""

import numbers
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from editing import tree as tree_lib
from editing.errors import UserError
from editing.lora import LowRank

PyTree = Any


@flax.struct.dataclass
class TaskVector:
  """A fine-tuning delta with its provenance.

  Attributes:
    delta: the params-shaped pytree θ_ft − θ0; for a LoRA vector, {path: LowRank} of the
      adapted kernels.
    tasks: the names of the tasks this vector encodes (several after a sum).
    regime: the fine-tuning regime, e.g. 'full'.
    base: the `tree.fingerprint` of θ0.
  """

  delta: PyTree
  tasks: tuple[str, ...] = flax.struct.field(pytree_node=False)
  regime: str = flax.struct.field(pytree_node=False)
  base: str = flax.struct.field(pytree_node=False)

  @classmethod
  def from_params(cls, base_params: PyTree, finetuned: PyTree, *, task: str,
                  regime: str) -> 'TaskVector':
    """τ = θ_ft − θ0, computed in float32 whatever the params' dtype."""
    tree_lib.check_same_structure(base_params, finetuned, 'base params', 'fine-tuned params')
    delta = jax.tree.map(lambda t, b: jnp.asarray(t, jnp.float32) - jnp.asarray(b, jnp.float32),
                         finetuned, base_params)
    return cls(delta, (task,), regime, tree_lib.fingerprint(base_params))

  def _combine(self, other: 'TaskVector', op) -> 'TaskVector':
    if not isinstance(other, TaskVector):
      return NotImplemented
    check_compatible([self, other], 'combine')
    tasks = self.tasks + tuple(t for t in other.tasks if t not in self.tasks)
    if self.low_rank:
      if op is jnp.subtract:
        other = -other
      delta = {path: self.delta[path] + other.delta[path] for path in self.delta}
    else:
      delta = jax.tree.map(op, self.delta, other.delta)
    return TaskVector(delta, tasks, self.regime, self.base)

  @property
  def low_rank(self) -> bool:
    """Whether the delta is kept as LoRA factors."""
    return any(isinstance(d, LowRank) for d in _leaves(self.delta))

  def materialized(self, base_params: PyTree) -> 'TaskVector':
    """The same vector with a dense, params-shaped delta (zero where LoRA adapted nothing)."""
    if not self.low_rank:
      return self
    self.check_fits(base_params, str(self.tasks))
    delta = tree_lib.map_with_path(
        lambda path, b: self.delta[path].dense() if path in self.delta
        else jnp.zeros(jnp.shape(b), jnp.float32), base_params)
    return TaskVector(delta, self.tasks, self.regime, self.base)

  def check_fits(self, base_params: PyTree, name: str) -> None:
    """An error naming the first leaf where the delta does not fit the base params' tree."""
    if not self.low_rank:
      tree_lib.check_same_structure(base_params, self.delta, 'base params', name)
      return
    shapes = {p: np.shape(b) for p, b in tree_lib.flatten(base_params).items()}
    for path, factors in self.delta.items():
      if path not in shapes:
        raise UserError(f'{name}: its LoRA factors adapt {path}, which the base params lack')
      if tuple(factors.shape) != shapes[path]:
        raise UserError(f'{name}: its LoRA factors of {path} make a {tuple(factors.shape)} '
                        f'delta, the base leaf is {shapes[path]}')

  def __add__(self, other):
    return self._combine(other, jnp.add)

  def __radd__(self, other):
    # `sum(vectors)` starts from the integer 0.
    if isinstance(other, numbers.Number) and other == 0:
      return self
    return NotImplemented

  def __sub__(self, other):
    return self._combine(other, jnp.subtract)

  def __neg__(self):
    return self * -1

  def __mul__(self, scale):
    if isinstance(scale, TaskVector):
      return NotImplemented
    return self.replace(delta=jax.tree.map(
        lambda d: d.scaled(scale) if isinstance(d, LowRank) else scale * d, self.delta,
        is_leaf=_is_factors))

  __rmul__ = __mul__

  def apply_to(self, base_params: PyTree, alpha=1.0) -> PyTree:
    """θ0 + α·τ, in the base params' dtypes. With α = 0 the base comes back unchanged."""
    self.check_fits(base_params, str(self.tasks))
    if self.low_rank:
      return tree_lib.map_with_path(
          lambda path, b: (b + alpha * self.delta[path].dense()).astype(b.dtype)
          if path in self.delta else b, base_params)
    return jax.tree.map(lambda b, d: (b + alpha * d).astype(b.dtype), base_params, self.delta)

  def norm(self) -> jax.Array:
    """The L2 norm ‖τ‖ over all entries (a LoRA vector's over its adapted kernels)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(d)) for d in _dense_leaves(self.delta)))

  def dot(self, other: 'TaskVector') -> jax.Array:
    check_compatible([self, other], 'dot')
    return sum(jnp.vdot(a, b) for a, b in zip(_dense_leaves(self.delta),
                                             _dense_leaves(other.delta)))

  def cosine(self, other: 'TaskVector') -> jax.Array:
    """⟨τ_a, τ_b⟩ / (‖τ_a‖ ‖τ_b‖)."""
    return self.dot(other) / (self.norm() * other.norm())

  def sparsity(self) -> jax.Array:
    """The share of entries that are exactly zero (a LoRA vector's in its adapted kernels)."""
    leaves = _dense_leaves(self.delta)
    zeros = sum(jnp.sum(d == 0) for d in leaves)
    return zeros / sum(d.size for d in leaves)


def check_compatible(vectors: Sequence[TaskVector], what: str) -> None:
  """At least one vector; all of one regime and base, with one tree (else name the path)."""
  if not vectors:
    raise UserError(f'{what} needs at least one task vector')
  first = vectors[0]
  for other in vectors[1:]:
    if (other.regime, other.base) != (first.regime, first.base):
      reason = 'regimes' if other.regime != first.regime else 'base models'
      raise UserError(f'{what}: task vectors of {first.tasks} ({first.regime}, base '
                       f'{first.base}) and {other.tasks} ({other.regime}, base {other.base}) '
                       f'come from different {reason}')
    if first.low_rank != other.low_rank:
      raise UserError(f'{what}: {first.tasks} and {other.tasks} mix LoRA factors with a dense '
                      'delta; materialize the LoRA vector first (TaskVector.materialized)')
    if first.low_rank:
      adapted = {p: d.shape for p, d in first.delta.items()}
      if adapted != {p: d.shape for p, d in other.delta.items()}:
        raise UserError(f'{what}: the LoRA vectors of {first.tasks} and {other.tasks} adapt '
                        f'different kernels: {sorted(adapted.keys() ^ other.delta.keys())[:3]}')
    else:
      tree_lib.check_same_structure(first.delta, other.delta, f'{what}: {first.tasks}',
                                    str(other.tasks))


def _is_factors(x) -> bool:
  return isinstance(x, LowRank)


def _leaves(delta: PyTree) -> list:
  return jax.tree.leaves(delta, is_leaf=_is_factors)


def _dense_leaves(delta: PyTree) -> list[jax.Array]:
  return [d.dense() if isinstance(d, LowRank) else d for d in _leaves(delta)]
