"""LoRA-space merges of PEFT adapters (KnOTS, PEFT's combinations): the merge is an adapter.

Every fine-tuned model is a PEFT adapter directory over the base, adapting the same modules;
their factors are merged as LoRA task vectors (`merging.knots`, `merging.peft_combinations`),
scaled by λ, and written as one adapter (adapter_config.json, adapter_model.safetensors) that
PEFT loads over the base.
"""

import jax
import numpy as np

import merging
from editing.errors import UserError
from editing.models import peft_adapter
from editing.task_vector import TaskVector


def write(base, adapters, directory: str, plan, base_path: str) -> dict:
  """Merges the `adapters` over `base` (an hf.Checkpoint) into `directory`; returns the
  merged ranks by module."""
  if plan.layered or plan.per_model:
    raise UserError(f'config.method = {plan.method}: a LoRA-space merge takes one value per '
                    'setting; config.layered and config.per_model are for dense merges')
  found = [peft_adapter.factors_over(base, a) for a in adapters]
  for path, factors in zip(adapters[1:], found[1:]):
    if factors.keys() != found[0].keys():
      raise UserError(f'{path} adapts other modules than {adapters[0]}: '
                      f'{sorted(factors.keys() ^ found[0].keys())[:3]}')
  vectors = [TaskVector({weight[:-len('.weight')]: f for weight, f in factors.items()}, (path,),
                        'lora', base_path) for path, factors in zip(adapters, found)]
  method = merging.get(plan.method)
  extra = {'key': jax.random.PRNGKey(plan.seed)} if 'key' in method.reads else {}
  if plan.weights is not None:
    extra['weights'] = list(plan.weights)
  merged = plan.scale * method.merge(vectors, **plan.settings, **extra)
  tensors, config = peft_adapter.tensors_and_config(merged.delta, base_path,
                                                    plan.output_dtype(np.dtype(np.float32)))
  peft_adapter.save(directory, tensors, config)
  return {'ranks': {m: f.rank for m, f in merged.delta.items()}}
