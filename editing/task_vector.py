"""Task vectors: τ = θ_ft − θ0 as a pytree that knows where it came from.

A `TaskVector` holds the delta (a params-shaped pytree) and static metadata: the tasks it
encodes, the fine-tuning regime that made it, and a fingerprint of the base θ0. Metadata is
static pytree aux data, so vectors pass through `jax.jit` and `jax.tree.map`, and mismatches are
caught at trace time.

Algebra (Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023):

  τ_a + τ_b,  τ_a − τ_b,  c·τ,  −τ,  sum([τ_1, ..., τ_T]),  θ0 + α·τ  (`apply_to`).

Vectors of different regimes or bases never combine: a linearized vector only means something on
the linearized model around its own θ0.
"""

import numbers
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from editing import tree as tree_lib
from editing.errors import UserError

PyTree = Any


@flax.struct.dataclass
class TaskVector:
  """A fine-tuning delta with its provenance.

  Attributes:
    delta: the params-shaped pytree θ_ft − θ0.
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
    return TaskVector(jax.tree.map(op, self.delta, other.delta), tasks, self.regime, self.base)

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
    return self.replace(delta=jax.tree.map(jnp.negative, self.delta))

  def __mul__(self, scale):
    if isinstance(scale, TaskVector):
      return NotImplemented
    return self.replace(delta=jax.tree.map(lambda d: scale * d, self.delta))

  __rmul__ = __mul__

  def apply_to(self, base_params: PyTree, alpha=1.0) -> PyTree:
    """θ0 + α·τ, in the base params' dtypes. With α = 0 the base comes back unchanged."""
    tree_lib.check_same_structure(base_params, self.delta, 'base params', str(self.tasks))
    return jax.tree.map(lambda b, d: (b + alpha * d).astype(b.dtype), base_params, self.delta)

  def norm(self) -> jax.Array:
    """The L2 norm ‖τ‖ over all entries."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(d)) for d in jax.tree.leaves(self.delta)))

  def dot(self, other: 'TaskVector') -> jax.Array:
    tree_lib.check_same_structure(self.delta, other.delta, str(self.tasks), str(other.tasks))
    return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(self.delta),
                                             jax.tree.leaves(other.delta)))

  def cosine(self, other: 'TaskVector') -> jax.Array:
    """⟨τ_a, τ_b⟩ / (‖τ_a‖ ‖τ_b‖)."""
    return self.dot(other) / (self.norm() * other.norm())

  def sparsity(self) -> jax.Array:
    """The share of entries that are exactly zero."""
    leaves = jax.tree.leaves(self.delta)
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
    tree_lib.check_same_structure(first.delta, other.delta, f'{what}: {first.tasks}',
                                  str(other.tasks))
