"""The in-memory reference a streamed checkpoint merge must equal, and an output reader."""

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing.models import hf
from merging.checkpoints import plan as plan_lib
from merging.checkpoints import tensors


def in_memory(base: str, models: Sequence[str], plan: plan_lib.Plan) -> dict[str, np.ndarray]:
  """The same merge over whole models at once, ranking inside it. Jitted as the streamed merge
  is (DARE op by op, as it is there): XLA contracts a·b + c into one fused multiply-add and
  divides by a constant as a multiply by its reciprocal, so an op-by-op merge and a jitted one
  may differ in the last bit. A method that scores entries on the host (SCE's variances) ranks
  them only outside jit, as the streamed merge does: op by op too."""
  base_ckpt = hf.Checkpoint(base)
  stored = {n: base_ckpt.tensor(n) for n in base_ckpt.files}
  floats = {n: jnp.asarray(x) for n, x in stored.items() if jnp.issubdtype(x.dtype, jnp.floating)}
  tuned = [{n: ckpt.tensor(n) for n in floats} for ckpt in map(hf.Checkpoint, models)]
  labels = [f'model_{i}' for i in range(len(models))]
  op_by_op = plan.whole_tensor or plan.scores is not None
  edit = tensors.edit if op_by_op else jax.jit(tensors.edit, static_argnums=0)
  edited = edit(plan, floats, tensors.task_vectors(floats, tuned, labels),
                jax.random.PRNGKey(plan.seed))
  return {**stored, **{n: np.asarray(x).astype(plan.output_dtype(stored[n].dtype), copy=False)
                       for n, x in edited.items()}}


def read_output(output: str) -> dict[str, np.ndarray]:
  ckpt = hf.Checkpoint(output)
  return {n: ckpt.tensor(n) for n in ckpt.files}
