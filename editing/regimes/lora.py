"""LoRA and linearized LoRA: θ0 stays frozen and only low-rank factors of chosen kernels train.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, as PEFT sets it up:
each targeted kernel becomes W0 + s·B A with B (outputs × r) at zero, A (r × inputs) drawn as
PyTorch's kaiming_uniform(a=√5) draws it, U(−1/√inputs, 1/√inputs), and s = α/r (rsLoRA,
Kalajdzievski 2023: α/√r). The task vector keeps the factors (`editing.lora.LowRank`).

L-LoRA (Tang et al., "Parameter-Efficient Multi-Task Model Fusion with Partial Linearization",
ICLR 2024) trains the first-order Taylor model in the adapter parameters p = (A, B) around their
initialisation p0. With B0 = 0 the weights' linearization is θ0 + s·(B − B0) A0 + s·B0 (A − A0)
= θ0 + s·B A0: A receives no gradient and only B trains, and the model is the NTK linearization
around θ0 (`editing.regimes.linearized`) evaluated at that weight. So L-LoRA is this regime with
A frozen, read through the linearized regime's encoder, and its task vector is exactly linear in
the trained B.

Defaults are PEFT's: r = 8, α = 8, the query and value projections (PEFT's target modules for
CLIP, ViT and BERT).
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from editing import lora
from editing import settings as settings_lib
from editing import tree as tree_lib
from editing.errors import UserError
from editing.regimes.base import ApplyFn, Encoder, PyTree, Regime
from editing.regimes.linearized import Linearized
from editing.task_vector import TaskVector

QUERY_VALUE = r'(.*/)?attn/(query|value)/kernel'


@dataclasses.dataclass(frozen=True)
class LoRA(Regime, settings_lib.Declared):
  """Low-rank adapters on the kernels whose paths match `targets`; its settings (config.lora,
  config.l_lora) are declared in `settings`.

  Attributes:
    linear: train the linearization in the adapter (L-LoRA) instead of the adapted model.
  """

  settings = dict(
      rank=settings_lib.integer(8, '[1, inf)', 'r, the factors\' inner dimension'),
      alpha=settings_lib.number(8.0, '(0, inf)', 'α of the scale s = α/r'),
      rslora=settings_lib.flag(False, 'scale by α/√r instead (rank-stabilized LoRA)'),
      targets=settings_lib.text(QUERY_VALUE, 'a regex that each adapted leaf\'s \'/\'-joined '
                                             'path matches in full'))

  rank: int = settings['rank'].default
  alpha: float = settings['alpha'].default
  rslora: bool = settings['rslora'].default
  targets: str = settings['targets'].default
  linear: bool = False

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

  def targeted(self, theta0: PyTree) -> dict[str, tuple[int, int]]:
    """{path: (inputs, outputs)} of the kernels adapted, checked: some match, each has room."""
    flat = tree_lib.flatten(theta0)
    matched = {p: lora.matrix_shape(p, np.shape(v)) for p, v in flat.items()
               if re.fullmatch(self.targets, p)}
    if not matched:
      raise UserError(f'{self.name}.targets = {self.targets!r} matches no leaf of θ0 (its paths '
                      f'look like {next(iter(flat))!r})')
    for path, (inputs, outputs) in matched.items():
      if self.rank > min(inputs, outputs):
        raise UserError(f'{self.name}.rank = {self.rank} exceeds the {inputs} × {outputs} '
                        f'matrix of {path}')
    return matched

  def initial(self, theta0, key):
    factors = {}
    for path, (inputs, outputs) in self.targeted(theta0).items():
      bound = 1 / math.sqrt(inputs)
      factors[f'{path}/a'] = jax.random.uniform(
          jax.random.fold_in(key, tree_lib.stable_hash(path)), (self.rank, inputs),
          jnp.float32, -bound, bound)
      factors[f'{path}/b'] = jnp.zeros((outputs, self.rank), jnp.float32)
    return tree_lib.unflatten(factors)

  def trainable(self, params):
    return {p: not (self.linear and p.endswith('/a')) for p in tree_lib.flatten(params)}

  def encoder(self, apply_fn: ApplyFn) -> Encoder:
    return Linearized(self.name).encoder(apply_fn) if self.linear else super().encoder(apply_fn)

  def weights(self, theta0, params):
    return TaskVector(self._factors(theta0, params), (), self.name, '').apply_to(theta0)

  def task_vector(self, theta0, trained, *, task):
    return TaskVector(self._factors(theta0, trained), (task,), self.name,
                      tree_lib.fingerprint(theta0))

  def _factors(self, theta0, trained) -> dict[str, lora.LowRank]:
    flat, shapes = tree_lib.flatten(trained), tree_lib.flatten(theta0)
    scale = jnp.float32(self.scale)
    return {p: lora.LowRank(flat[f'{p}/b'], flat[f'{p}/a'], scale, np.shape(shapes[p]))
            for p in sorted({p.rsplit('/', 1)[0] for p in flat})}


LORA = LoRA('lora')
L_LORA = LoRA('l_lora', linear=True)
