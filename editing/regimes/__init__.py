"""Fine-tuning regimes: which leaves move, and through which function of the params.

A regime is a small object the one training loop and the evaluator share:

- ``initial(theta0, key)``, ``weights(theta0, params)``: what trains (θ0's own leaves, or
  LoRA's factors) and the model's params it makes;
- ``trainable(params) -> {path: bool}``: the leaves of what trains that fine-tuning changes;
- ``encoder(apply_fn) -> fn(theta0, params, images)``: the function of the model's params that
  is trained and evaluated (the model itself, or its linearization around θ0);
- ``update_mask(params, logits_fn=, images=, key=)``: elementwise masks on the updates, fitted
  on calibration data before training (TaLoS), or None;
- ``task_vector(theta0, trained, task=)``: the difference fine-tuning made.

Task vectors record the regime that made them, and the evaluator applies them through the same
regime's encoder.
"""

from typing import Any, Mapping

from editing import registry
from editing.regimes.attention_only import ATTENTION_ONLY
from editing.regimes.base import Regime
from editing.regimes.full import FULL
from editing.regimes.linearized import LINEARIZED
from editing.regimes.lora import L_LORA, LORA
from editing.regimes.talos import TALOS

REGISTRY: dict[str, Regime] = {r.name: r for r in (FULL, ATTENTION_ONLY, LINEARIZED, TALOS, LORA,
                                                   L_LORA)}

# The regimes whose task vectors act through the tangent model at θ0, not the model itself.
TANGENT = (LINEARIZED.name, L_LORA.name)


def get(name: str, settings: Mapping[str, Any] | None = None) -> Regime:
  """The regime `name`, with its settings (e.g. TaLoS's keep, rounds) overridden by `settings`."""
  return registry.configured(REGISTRY, name, 'regime', settings,
                             fixed=('name', 'trainable_patterns', 'linear'))
