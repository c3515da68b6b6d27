"""A fine-tuned checkpoint's task vector written as a PEFT LoRA adapter (`extract_lora`), as
mergekit-extract-lora writes one.

Each module with a 2-D weight (a linear layer, as PyTorch stores it: outputs × inputs) gets
the truncated factors of its τ (`editing.lora.factor`); the modules LoRA does not factor
(norms and other vectors; the token tables and the head unless `embed_lora`) are saved whole
in `modules_to_save`, with the fine-tuned weights, or left out (`whole='skip'`). With
`embed_lora`, as mergekit-extract-lora's --embed-lora, the head is factored as a linear layer
and each token or position table (num_embeddings × dim) as PEFT's embedding LoRA, whose
ΔW = (B A)ᵀ: the factors of τᵀ, saved as lora_embedding_A (r × num_embeddings) and
lora_embedding_B (dim × r). A linear
layer's changed bias has no place in a LoRA adapter (PEFT's lora_bias is not written) and is
refused. adapter_config.json sets lora_alpha = r, so PEFT's scale α/r is 1, with a
rank_pattern and alpha_pattern for the modules of fewer singular values. Every tensor is read
once, a tensor at a time; the factors, small, are written when all are known. Each factor's
r ≪ min(outputs, inputs) triplets may be found by a randomized sketch (`svd='randomized'`,
`merging.svd`) instead of mergekit's full SVD.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
from absl import logging

from editing import atomic
from editing import lora
from editing import settings
from editing.errors import UserError
from editing.models import hf
from editing.models import peft_adapter
from merging import svd as svd_lib

REPORT = 'extraction.json'
_EMBEDDINGS = ('embed', 'wte', 'wpe', 'shared')  # token or position tables
_HEAD = 'lm_head'


@settings.declare(
    whole=settings.choice('save', ('save', 'skip'), 'the modules LoRA does not factor: saved '
                          'whole in modules_to_save, or left out'),
    embed_lora=settings.flag(False, 'factor the token tables (embedding LoRA) and the head too'),
    svd=svd_lib.SETTING,
    **lora.factor.settings)
def options(**chosen) -> dict:
  """The extraction's settings (`factor`'s and `whole`), checked."""
  return chosen


def _modules(base: hf.Checkpoint) -> dict[str, dict[str, str]]:
  """{module: {parameter: tensor name}} of the floating tensors."""
  modules = {}
  for name in sorted(base.files):
    if jnp.issubdtype(base.header(name)[1], jnp.floating):
      module, _, parameter = name.rpartition('.')
      modules.setdefault(module, {})[parameter] = name
  return modules


def _embedding(module: str) -> bool:
  return any(table in module for table in _EMBEDDINGS)


def _factored(module: str, parameters: dict, base: hf.Checkpoint, embed_lora: bool) -> bool:
  weight = parameters.get('weight')
  tables = _embedding(module) or _HEAD in module
  return (weight is not None and len(base.header(weight)[0]) == 2 and
          (embed_lora or not tables))


def write(base: hf.Checkpoint, tuned: hf.Checkpoint, directory: str, chosen: dict,
          base_path: str) -> dict:
  """Writes the adapter of `tuned` over `base` into `directory`; returns what each module
  kept."""
  factor_settings = {k: v for k, v in chosen.items() if k not in ('whole', 'embed_lora', 'svd')}
  top = None if chosen['svd'] == 'full' else svd_lib.top_singular
  tensors, ranks, energies, saved = {}, {}, {}, []
  for module, parameters in _modules(base).items():
    if not _factored(module, parameters, base, chosen['embed_lora']):
      if chosen['whole'] == 'save':
        saved.append(module)
        for parameter, name in parameters.items():
          tensors[lora.saved_key(module, parameter)] = tuned.tensor(name)
      continue
    for parameter, name in parameters.items():
      if parameter != 'weight' and not np.array_equal(base.tensor(name), tuned.tensor(name)):
        raise UserError(f'{tuned.path}: {name} differs from the base, and a LoRA adapter has '
                        f'no place for a changed {parameter} (PEFT\'s lora_bias is not written)')
    name = parameters['weight']
    delta = tuned.tensor(name).astype(np.float32) - base.tensor(name).astype(np.float32)
    embedding = _embedding(module)
    factors, energies[module] = lora.factor(delta.T if embedding else delta, name=name, top=top,
                                            **factor_settings)
    key_a, key_b = (lora.embedding_keys if embedding else lora.lora_keys)(module)
    tensors[key_a], tensors[key_b] = factors.a, factors.b
    ranks[module] = factors.rank
  if not ranks:
    raise UserError(f'{base.path}: no linear layer (2-D weight) to factor')
  rank = max(ranks.values())
  smaller = {m: r for m, r in ranks.items() if r != rank}
  config = peft_adapter.config(rank=rank, alpha=rank, rank_pattern=smaller,
                               alpha_pattern=smaller, base_path=base_path,
                               target_modules={m.rpartition('.')[2] for m in ranks},
                               modules_to_save=saved)
  peft_adapter.save(directory, tensors, config)
  report = {'rank': rank, 'modules': {m: {'rank': ranks[m], 'energy': energies[m]}
                                      for m in ranks}, 'modules_to_save': saved}
  atomic.write_json(os.path.join(directory, REPORT), report)
  logging.info('LoRA of %d modules, rank ≤ %d, keeping %.4f of τ\'s energy at least (%s)',
               len(ranks), rank, min(energies.values()), json.dumps(
                   {m: round(e, 4) for m, e in energies.items()}))
  return report
