"""Fine-tuning regimes: which leaves move, and through which function of the params.

A regime is a small object the one training loop and the evaluator share:

- ``trainable(params) -> {path: bool}``: the leaves fine-tuning may change;
- ``encoder(apply_fn) -> fn(theta0, params, images)``: the function of the params that is
  trained and evaluated (the model itself, or its linearization around θ0);
- ``update_mask(params, logits_fn=, images=, key=)``: elementwise masks on the updates, fitted
  on calibration data before training (TaLoS), or None.

Task vectors record the regime that made them, and the evaluator applies them through the same
regime's encoder.
"""

import dataclasses
from typing import Any, Mapping

from editing.regimes.attention_only import ATTENTION_ONLY
from editing.regimes.base import Regime
from editing.regimes.full import FULL
from editing.regimes.linearized import LINEARIZED
from editing.regimes.talos import TALOS

REGISTRY: dict[str, Regime] = {r.name: r for r in (FULL, ATTENTION_ONLY, LINEARIZED, TALOS)}


def get(name: str, settings: Mapping[str, Any] | None = None) -> Regime:
  """The regime `name`, with its settings (e.g. TaLoS's keep, rounds) overridden by `settings`."""
  try:
    regime = REGISTRY[name]
  except KeyError:
    raise ValueError(f'unknown regime {name!r}; known: {sorted(REGISTRY)}') from None
  if not settings:
    return regime
  fields = {f.name for f in dataclasses.fields(regime)} - {'name', 'trainable_patterns'}
  unknown = sorted(set(settings) - fields)
  if unknown:
    raise ValueError(f'{name}.{unknown[0]} is not a setting of the {name} regime; settings: '
                     f'{sorted(fields)}')
  return dataclasses.replace(regime, **settings)
