"""mergekit's passthrough with `slices`: a model built from layer ranges of other models (a
"frankenmerge"), streamed block by block at the speed of a copy.

Each slice takes the layers [a, b) of one model; the slices are stacked in order and their
layers renumbered 0 … L − 1. A tensor's layer is the first `.<number>.` of its name
(`layered.layer_of`); of the others, the token and position tables (names holding 'embed',
'wte' or 'wpe') come from the first slice's model and the rest (the final norm, the head)
from the last's, as mergekit plans them. `scale`, a value per tensor (`layered`: a gradient
over the output's layers, or per module), multiplies each tensor (mergekit's passthrough
parameter), so that `scale: [{filter: o_proj, value: 0}, {value: 1}]` zeroes the attention
outputs of duplicated layers; a filter matches the input tensor's name, before its layer is
renumbered, as mergekit matches it. The output's config.json is the first model's with its
layer count set to L; its tokenizer files are the first model's, or `tokenizer` names another.
The output is written as every checkpoint is (`output`): a killed passthrough resumes.
"""

import dataclasses
import json
import math
import os
import re
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from absl import logging

from editing import safetensors_io
from editing.errors import UserError
from editing.models import hf
from merging.checkpoints import layered
from merging.checkpoints import output as output_lib
from merging.checkpoints import pipeline
from merging.checkpoints import plan as plan_lib

_TABLES = ('embed', 'wte', 'wpe')
_LAYER_COUNTS = ('num_hidden_layers', 'n_layer', 'num_layers')
# The output's config.json is the first model's, its layer count changed; the rest is copied.
_COPIED = tuple(name for name in output_lib.COPIED if name != 'config.json')


@dataclasses.dataclass(frozen=True)
class Slice:
  model: str
  start: int
  stop: int  # exclusive, as mergekit's layer_range


def _renamed(name: str, layer: int) -> str:
  match = re.search(r'\.(\d+)\.', name)
  return name[:match.start(1)] + str(layer) + name[match.end(1):]


def sources(slices: Sequence[Slice],
            ckpts: Sequence[hf.Checkpoint]) -> dict[str, tuple[hf.Checkpoint, str]]:
  """{output tensor: (checkpoint, its tensor)} in the output's order, every range checked."""
  out, offset, template = {}, 0, None
  for i, (piece, ckpt) in enumerate(zip(slices, ckpts)):
    layers = {}
    for name in ckpt.files:
      if layered.layer_of(name) is not None:
        layers.setdefault(layered.layer_of(name), []).append(name)
    contiguous = sorted(layers) == list(range(len(layers)))
    if not (contiguous and 0 <= piece.start < piece.stop <= len(layers)):
      raise UserError(f'slices[{i}]: {piece.model} has layers 0 … {len(layers) - 1}; the '
                      f'layer_range [{piece.start}, {piece.stop}) is not among them')
    for layer in range(piece.start, piece.stop):
      shapes = {_renamed(n, 0): ckpt.header(n) for n in layers[layer]}
      template = template or shapes
      if shapes != template:
        raise UserError(f'slices[{i}]: layer {layer} of {piece.model} has other tensors or '
                        'shapes than the first slice\'s layers (models of different '
                        'architectures)')
      for name in sorted(layers[layer]):
        out[_renamed(name, offset + layer - piece.start)] = (ckpt, name)
    offset += piece.stop - piece.start
  for ckpt, pre in ((ckpts[0], True), (ckpts[-1], False)):
    for name in ckpt.files:
      if layered.layer_of(name) is None and any(t in name for t in _TABLES) == pre:
        out[name] = (ckpt, name)
  return dict(sorted(out.items()))


def run(slices: Sequence[Slice], output: str, *, scale: Any = 1.0, dtype: str | None = None,
        tokenizer: str | None = None, shard_bytes: int = 2 * 1024**3, overwrite: bool = False,
        recipe: str | None = None) -> dict:
  """Writes the model of `slices` into the Hugging Face directory `output`."""
  layered.check(scale, 'config.passthrough.scale')
  if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
             for v in layered.anchors(scale)):
    raise UserError(f'config.passthrough.scale = {scale!r}: finite numbers')
  if not slices:
    raise UserError('config.passthrough.slices: no slice to stack')
  if dtype and dtype not in plan_lib.OUTPUT_DTYPES:
    raise UserError(f'config.dtype = {dtype!r}: the output can be written in one of '
                    f'{sorted(plan_lib.OUTPUT_DTYPES)}')
  tokenizer_source = tokenizer or slices[0].model
  inputs = [s.model for s in slices] + [tokenizer_source]
  output_lib.checked_path(output, inputs)
  models = list(dict.fromkeys(s.model for s in slices))
  ckpts = {model: hf.Checkpoint(model) for model in models}
  names = sources(slices, [ckpts[s.model] for s in slices])
  entries = []
  for name, (ckpt, source) in names.items():
    shape, stored = ckpt.header(source)
    floating = jnp.issubdtype(stored, jnp.floating)
    entries.append((name, shape, plan_lib.OUTPUT_DTYPES[dtype] if dtype and floating else stored))
  shards = safetensors_io.plan_shards(entries, shard_bytes)
  layers = sum(s.stop - s.start for s in slices)
  record = {'plan': {'method': 'passthrough', 'slices': [[s.model, s.start, s.stop]
                                                         for s in slices],
                     'scale': scale, 'dtype': dtype, 'tokenizer': tokenizer},
            'inputs': [output_lib.fingerprint(ckpts[m]) for m in models],
            'shards': [{'file': s.file, 'names': s.names} for s in shards]}
  target = output_lib.Target(output, inputs, record, readers=[ckpts[m] for m in models],
                             card=_card(recipe), copied_from=tokenizer_source, copied=_COPIED,
                             config=_config(slices[0].model, layers))

  def fill(partial: output_lib.Partial) -> None:
    readers = dict(zip(models, partial.readers))
    stacked = {name: (readers[ckpt.path], source) for name, (ckpt, source) in names.items()}
    _write_shards(partial, stacked, shards, scale)

  output_lib.write(target, fill, overwrite=overwrite)
  logging.info('passthrough of %d slices, %d layers, in %s', len(slices), layers, output)
  return {'output': os.path.abspath(output), 'tensors': len(names), 'shards': len(shards),
          'layers': layers}


def _write_shards(partial: output_lib.Partial, names: dict, shards, scale: Any) -> None:
  """Each shard not yet in `partial`, its tensors copied a block at a time, each scaled by its
  value of `scale` (resolved on the input tensor's name and the output layer's position);
  then the index."""
  positions = layered.positions(list(names))
  written = {name: dtype for shard in shards for name, _, dtype in shard.entries}

  def prepare(name):
    ckpt, source = names[name]
    return ckpt, source, layered.resolve(scale, source, positions[name]), written[name]

  def block(state, start, stop):
    ckpt, source, factor, dtype = state
    x = ckpt.read(source, start, stop)
    if factor not in (None, 1) and jnp.issubdtype(x.dtype, jnp.floating):
      x = x.astype(np.float32) * np.float32(factor)
    return x.astype(dtype, copy=False)

  pipeline.write_shards(partial, shards, prepare, block, 2)


def _card(recipe: str | None) -> str | None:
  """The model card of a passthrough a mergekit `recipe` (its YAML text) described."""
  if recipe is None:
    return None
  return f'# Merged model\n\nmergekit passthrough of slices.\n\n```yaml\n{recipe.rstrip()}\n```\n'


def _config(model: str, layers: int) -> dict | None:
  """The config.json of `model` with the output's layer count; None if it has none."""
  path = os.path.join(model, 'config.json')
  if not os.path.isdir(model) or not os.path.exists(path):
    return None
  with open(path) as f:
    return with_layers(json.load(f), layers)


def with_layers(config: dict, layers: int) -> dict:
  """A model config with its layer count (under whichever name it has) set to `layers`."""
  return {k: layers if k in _LAYER_COUNTS else v for k, v in config.items()}
