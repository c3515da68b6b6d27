"""Fine-tuning regimes: which leaves move, and through which function of the params.

A regime is a small object the one training loop and the evaluator share:

- ``trainable(params) -> {path: bool}``: the leaves fine-tuning may change;
- ``encoder(apply_fn) -> fn(theta0, params, images)``: the function of the params that is
  trained and evaluated (the model itself, or its linearization around θ0).

Task vectors record the regime that made them, and the evaluator applies them through the same
regime's encoder.
"""

from editing.regimes.attention_only import ATTENTION_ONLY
from editing.regimes.base import Regime
from editing.regimes.full import FULL
from editing.regimes.linearized import LINEARIZED

REGISTRY: dict[str, Regime] = {r.name: r for r in (FULL, ATTENTION_ONLY, LINEARIZED)}


def get(name: str) -> Regime:
  try:
    return REGISTRY[name]
  except KeyError:
    raise ValueError(f'unknown regime {name!r}; known: {sorted(REGISTRY)}') from None
