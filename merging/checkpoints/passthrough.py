"""mergekit's passthrough with `slices`: a model built from layer ranges of other models (a
"frankenmerge"), streamed block by block at the speed of a copy.

Each slice takes the layers [a, b) of one model; the slices are stacked in order and their
layers renumbered 0 … L − 1. A tensor's layer is the first `.<number>.` of its name
(`layered.layer_of`); of the others, the token and position tables (names holding 'embed',
'wte' or 'wpe') come from the first slice's model and the rest (the final norm, the head)
from the last's, as mergekit plans them. `scale`, a value per tensor (`layered`: a gradient
over the output's layers, or per module), multiplies each tensor (mergekit's passthrough
parameter), so that `scale: [{filter: o_proj, value: 0}, {value: 1}]` zeroes the attention
outputs of duplicated layers. The output's config.json is the first model's with its layer
count set to L; its tokenizer files are the first model's, or `tokenizer` names another.
"""

import dataclasses
import json
import math
import os
import re
import shutil
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from absl import logging

from editing import atomic
from editing import safetensors_io
from editing.errors import UserError
from editing.jobs import lock
from editing.models import hf
from merging.checkpoints import layered
from merging.checkpoints import pipeline

_TABLES = ('embed', 'wte', 'wpe')
_LAYER_COUNTS = ('num_hidden_layers', 'n_layer', 'num_layers')
_COPIED = ('generation_config.json', 'tokenizer.json', 'tokenizer_config.json',
           'special_tokens_map.json', 'tokenizer.model', 'vocab.txt', 'vocab.json', 'merges.txt')


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
  ckpts = [hf.Checkpoint(s.model) for s in slices]
  names = sources(slices, ckpts)
  positions = layered.positions(list(names))
  out_dtype = {'float32': np.float32, 'bfloat16': jnp.bfloat16, 'float16': np.float16}.get(dtype)
  if dtype and out_dtype is None:
    raise UserError(f'config.dtype = {dtype!r}: float32, bfloat16 or float16')
  entries = []
  for name, (ckpt, source) in names.items():
    shape, stored = ckpt.header(source)
    floating = jnp.issubdtype(stored, jnp.floating)
    entries.append((name, shape, np.dtype(out_dtype) if out_dtype and floating else stored))
  shards = safetensors_io.plan_shards(entries, shard_bytes)
  output = os.path.abspath(output)
  if os.path.exists(output) and not overwrite:
    raise UserError(f'config.output = {output} exists; choose another path, or set '
                    'config.overwrite=True to replace it')
  for piece in slices:
    if os.path.abspath(piece.model) in (output, os.path.dirname(output)):
      raise UserError(f'config.output = {output} overlaps the input {piece.model}')
  partial = output + '.partial'
  lock_file = os.path.join(os.path.dirname(output), f'.{os.path.basename(output)}.lock')
  with lock.held(lock_file, f'the merge output {output}'):
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)

    written = {name: dtype for name, _, dtype in entries}

    def prepare(name):
      ckpt, source = names[name]
      return ckpt, source, layered.resolve(scale, name, positions[name]), written[name]

    def block(state, start, stop):
      ckpt, source, factor, dtype = state
      x = ckpt.read(source, start, stop)
      if factor not in (None, 1) and jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(np.float32) * np.float32(factor)
      return x.astype(dtype, copy=False)

    try:
      for shard in shards:
        pipeline.write_streamed(os.path.join(partial, shard.file), shard.entries, prepare,
                                block, 2)
    except UserError:
      shutil.rmtree(partial, ignore_errors=True)
      raise
    safetensors_io.write_index(partial, shards)
    _write_config(slices, partial, offset_total=sum(s.stop - s.start for s in slices))
    first = tokenizer or slices[0].model
    for name in _COPIED:
      if os.path.isdir(first) and os.path.exists(os.path.join(first, name)):
        shutil.copy(os.path.join(first, name), os.path.join(partial, name))
    if recipe is not None:
      atomic.write_bytes(os.path.join(partial, 'README.md'),
                         f'# Merged model\n\nmergekit passthrough of slices.\n\n```yaml\n'
                         f'{recipe.rstrip()}\n```\n'.encode())
    atomic.replace_directory(partial, output)
  logging.info('passthrough of %d slices, %d layers, in %s', len(slices),
               sum(s.stop - s.start for s in slices), output)
  return {'output': output, 'tensors': len(names), 'shards': len(shards),
          'layers': sum(s.stop - s.start for s in slices)}


def _write_config(slices: Sequence[Slice], directory: str, offset_total: int) -> None:
  """The first model's config.json with the output's layer count."""
  path = os.path.join(slices[0].model, 'config.json')
  if not os.path.isdir(slices[0].model) or not os.path.exists(path):
    return
  with open(path) as f:
    config = json.load(f)
  atomic.write_json(os.path.join(directory, 'config.json'), with_layers(config, offset_total))


def with_layers(config: dict, layers: int) -> dict:
  """A model config with its layer count (under whichever name it has) set to `layers`."""
  return {k: layers if k in _LAYER_COUNTS else v for k, v in config.items()}
