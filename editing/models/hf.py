"""Hugging Face checkpoints in and out: config.json plus safetensors, single or sharded.

Reading is lazy, a tensor (`Checkpoint.tensor`) or a range of its entries (`Checkpoint.read`)
at a time, from `model.safetensors` or the shards that `model.safetensors.index.json` names;
pickled weights (.bin, .pt, .pth, .ckpt) are refused unread, with how to convert them.
Importing checks every name at once: the error lists each tensor the model needs and the file
lacks, each tensor of the model's part of the file that nothing reads, and each shape that
differs. Tensors are read in the dtype they are stored in and cast to `config.model.dtype`.

Writing puts config.json and safetensors shards of at most `shard_bytes` (with the index when
there are several) into a temporary directory beside the target, then renames it into place:
a failure leaves nothing at the target path.

Families (`FAMILIES`), each with its key map in third_party/: 'clip_vision' and 'clip_text' (the
towers of CLIPModel and of CLIP{Vision,Text}Model[WithProjection]; hf_clip.py), 'vit' (ViTModel
and the `vit.` part of ViTForImageClassification: ViT, DeiT, DINO; hf_vit.py), 'bert'
(BertModel, and the `bert.` part of BERT task models; hf_bert.py), and, read only,
'open_clip_vision' and 'open_clip_text' (open_clip's CLIP state dicts; open_clip.py).
"""

import dataclasses
import json
import os
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from editing import atomic
from editing import registry
from editing import safetensors_io
from editing import tree as tree_lib
from editing.errors import UserError
from editing.models import bert
from editing.models import clip_text
from editing.models import keymap
from editing.models import vit
from third_party import hf_bert
from third_party import hf_clip
from third_party import hf_vit
from third_party import open_clip

SINGLE, INDEX = safetensors_io.SINGLE, safetensors_io.INDEX
# What transformers expects of a file's metadata.
PT_METADATA = {'format': 'pt'}
_PICKLES = ('pytorch_model.bin', 'model.bin', 'model.pt', 'model.pth', 'model.ckpt')


@runtime_checkable
class Reader(Protocol):
  """What a streamed merge reads a checkpoint through: a `Checkpoint`, or a view of one (a
  slice's tensors under the output's names, a base with an adapter merged into it, a reader
  whose reads are hashed for a resume to check)."""

  path: str
  config: dict  # its config.json
  files: Mapping[str, str]  # {tensor name: the file holding it}

  def header(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """A tensor's shape and numpy dtype, from the file's header alone."""

  def tensor(self, name: str) -> np.ndarray:
    """One tensor whole, as stored."""

  def read(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    """Entries [start, stop) of a tensor in row-major order, as stored, into `out` if given."""


class Checkpoint:
  """The tensors of a Hugging Face model directory (or an open_clip one: open_clip_config.json
  and open_clip_model.safetensors), or of one .safetensors file, read lazily."""

  def __init__(self, path: str):
    self.path = path
    self._files: dict[str, safetensors_io.File] = {}
    if os.path.isdir(path):
      open_clip_config = os.path.join(path, open_clip.CONFIG)
      self.config = _read_json(open_clip_config if os.path.exists(open_clip_config) and
                               not os.path.exists(os.path.join(path, 'config.json'))
                               else os.path.join(path, 'config.json'))
      self.files = self._weight_map(path)
    else:
      self.config = {}
      self.files = self._names_of(path)

  def _weight_map(self, directory: str) -> dict[str, str]:
    index, single = os.path.join(directory, INDEX), os.path.join(directory, SINGLE)
    if os.path.exists(index):
      weight_map = _read_json(index).get('weight_map')
      if not isinstance(weight_map, dict):
        raise UserError(f'{index} has no "weight_map" object')
      shards = sorted(set(weight_map.values()))
      missing = [s for s in shards if not os.path.exists(os.path.join(directory, s))]
      if missing:
        raise UserError(f'{index} names shard(s) {missing}, which are not in {directory}')
      files = {}
      for shard in shards:
        stored = self._names_of(os.path.join(directory, shard))
        for name, file in weight_map.items():
          if file == shard and name not in stored:
            raise UserError(f'{index} puts {name} in {shard}, which does not hold it')
        files.update(stored)
      return files
    for file in (single, os.path.join(directory, open_clip.WEIGHTS)):
      if os.path.exists(file):
        return self._names_of(file)
    pickled = [f for f in sorted(os.listdir(directory)) if f in _PICKLES or
               f.endswith(('.bin', '.pt', '.pth', '.ckpt'))]
    if pickled:
      raise UserError(f'{directory} holds only pickled weights ({", ".join(pickled)}), which are '
                      'never unpickled here; convert them to safetensors first, e.g. in PyTorch: '
                      'model.save_pretrained(directory, safe_serialization=True)')
    raise UserError(f'{directory} has neither {SINGLE} nor {INDEX}')

  def _names_of(self, path: str) -> dict[str, str]:
    """{name: path} of the file's tensors (opened here once: its header parsed and checked)."""
    self._files[path] = safetensors_io.File(path)
    return {name: path for name in self._files[path].names}

  def tensor(self, name: str) -> np.ndarray:
    """One tensor as stored (float32, bfloat16, float16, ...); KeyError if there is none."""
    return self._files[self.files[name]].tensor(name)

  def header(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """A tensor's shape and numpy dtype, from the file's header alone."""
    return self._files[self.files[name]].header(name)

  def read(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    """Entries [start, stop) of a tensor in row-major order, as stored, into `out` (see
    `safetensors_io.File.read`)."""
    return self._files[self.files[name]].read(name, start, stop, out)


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    raise FileNotFoundError(f'no {os.path.basename(path)} at {path}')
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(f'{path} is not valid JSON ({e})') from None


@dataclasses.dataclass(frozen=True)
class Family:
  """How one model family's Hugging Face checkpoints map onto an editmerge module."""

  rules: tuple  # keymap rules (our path, their name, layout)
  model_config: Callable[['Checkpoint'], dict]  # our config.model from the checkpoint
  # Their config.json from our config.model; None for a format not written here (open_clip's
  # towers are exported in Hugging Face's layout, as 'clip_vision' and 'clip_text').
  hf_config: Callable[[dict], dict] | None
  build: Callable[[ml_collections.ConfigDict], Any]  # the flax module
  example_inputs: Callable[[dict], tuple]  # inputs that trace the module (shapes only)
  owned: Callable[[str], bool]  # which of a file's tensors belong to this model
  ignored: tuple[str, ...] = ()  # saved buffers that are not parameters
  prefix: str = ''  # present in task models' checkpoints (e.g. 'bert.'), stripped
  # Other JSON files an export writes beside config.json, by name.
  extra_configs: Callable[[dict], dict[str, dict]] = lambda model: {}


def _clip_model_config(ckpt: 'Checkpoint') -> dict:
  with_projection = any(n.startswith('visual_projection.') for n in ckpt.files)
  return hf_clip.model_config(ckpt.config, with_projection=with_projection)


def _clip_text_model_config(ckpt: 'Checkpoint') -> dict:
  with_projection = any(n.startswith('text_projection.') for n in ckpt.files)
  return hf_clip.text_model_config(ckpt.config, with_projection=with_projection)


def _vit_model_config(ckpt: 'Checkpoint') -> dict:
  """ViTModel's config, with the pixel statistics of its preprocessor_config.json if any."""
  preprocessor_file = os.path.join(ckpt.path, 'preprocessor_config.json')
  preprocessor = (_read_json(preprocessor_file)
                  if os.path.isdir(ckpt.path) and os.path.exists(preprocessor_file) else None)
  with_pooler = any(n.startswith(('pooler.', 'vit.pooler.')) for n in ckpt.files)
  return hf_vit.model_config(ckpt.config, with_pooler=with_pooler, preprocessor=preprocessor)


def _bert_model_config(ckpt: 'Checkpoint') -> dict:
  """BertModel's config; mean pooling unless a sentence-transformers pooling config says CLS."""
  pooling = 'mean'
  pooling_file = os.path.join(ckpt.path, '1_Pooling', 'config.json')
  if os.path.isdir(ckpt.path) and os.path.exists(pooling_file):
    if _read_json(pooling_file).get('pooling_mode_cls_token'):
      pooling = 'cls'
  return hf_bert.model_config(ckpt.config, pooling=pooling)


FAMILIES = {
    'clip_vision': Family(
        rules=hf_clip.RULES, model_config=_clip_model_config, hf_config=hf_clip.hf_config,
        build=vit.build,
        example_inputs=lambda m: (jax.ShapeDtypeStruct(
            (1, m['image_size'], m['image_size'], 3), jnp.float32),),
        owned=lambda name: name.startswith(hf_clip.OWNED_PREFIXES)),
    'clip_text': Family(
        rules=hf_clip.TEXT_RULES, model_config=_clip_text_model_config,
        hf_config=hf_clip.text_hf_config, build=clip_text.build,
        example_inputs=lambda m: (jax.ShapeDtypeStruct((1, m['context_length']), jnp.int32),
                                  jax.ShapeDtypeStruct((1, m['context_length']), jnp.int32)),
        owned=lambda name: name.startswith(hf_clip.TEXT_OWNED_PREFIXES),
        ignored=hf_clip.TEXT_IGNORED),
    'vit': Family(
        rules=hf_vit.RULES, model_config=_vit_model_config, hf_config=hf_vit.hf_config,
        build=vit.build,
        example_inputs=lambda m: (jax.ShapeDtypeStruct(
            (1, m['image_size'], m['image_size'], 3), jnp.float32),),
        owned=lambda name: not name.startswith(hf_vit.NOT_OWNED_PREFIXES), prefix='vit.',
        extra_configs=lambda m: {'preprocessor_config.json': hf_vit.preprocessor_config(m)}),
    'open_clip_vision': Family(
        rules=open_clip.RULES, model_config=lambda ckpt: open_clip.model_config(ckpt.config),
        hf_config=None, build=vit.build,
        example_inputs=lambda m: (jax.ShapeDtypeStruct(
            (1, m['image_size'], m['image_size'], 3), jnp.float32),),
        owned=lambda name: name.startswith('visual.')),
    'open_clip_text': Family(
        rules=open_clip.TEXT_RULES,
        model_config=lambda ckpt: open_clip.text_model_config(ckpt.config),
        hf_config=None, build=clip_text.build,
        example_inputs=lambda m: (jax.ShapeDtypeStruct((1, m['context_length']), jnp.int32),
                                  jax.ShapeDtypeStruct((1, m['context_length']), jnp.int32)),
        owned=lambda name: not name.startswith(open_clip.NOT_TEXT)),
    'bert': Family(
        rules=hf_bert.RULES, model_config=_bert_model_config, hf_config=hf_bert.hf_config,
        build=bert.build,
        example_inputs=lambda m: (jax.ShapeDtypeStruct((1, 8), jnp.int32),
                                  jax.ShapeDtypeStruct((1, 8), jnp.int32)),
        owned=lambda name: not name.startswith(('cls.', 'classifier.', 'qa_outputs.')),
        ignored=hf_bert.IGNORED, prefix='bert.'),
}


def clip_towers(path: str) -> tuple[str, str | None]:
  """The families of the (image, text) towers of the CLIP checkpoint at `path`, in Hugging
  Face's or open_clip's layout; the text one is None if the checkpoint has no text tower."""
  ckpt = Checkpoint(path)
  if any(n.startswith('visual.') for n in ckpt.files):
    return 'open_clip_vision', ('open_clip_text' if 'token_embedding.weight' in ckpt.files
                                else None)
  return 'clip_vision', ('clip_text' if any(n.startswith('text_model.') for n in ckpt.files)
                         else None)


def load(path: str, family: str, dtype: str = 'float32') -> tuple[dict, dict]:
  """(params, config.model) of a `family` model in a Hugging Face directory or file."""
  fam = registry.lookup(FAMILIES, family, 'model family')
  ckpt = Checkpoint(path)
  model = dict(fam.model_config(ckpt), dtype=dtype)
  prefix = fam.prefix if any(n.startswith(fam.prefix) for n in ckpt.files) and fam.prefix else ''
  shapes = _our_shapes(fam, model)
  rules = [(ours, prefix + theirs, layout)
           for ours, theirs, layout in keymap.expand(fam.rules, model['depth']) if ours in shapes]
  ignored = {prefix + n for n in fam.ignored}
  owned = {n for n in ckpt.files
           if n.startswith(prefix) and fam.owned(n[len(prefix):]) and n not in ignored}
  expected = {theirs: keymap.their_shape(layout, shapes[ours]) for ours, theirs, layout in rules}
  problems = [f'missing {n}' for n in sorted(set(expected) - owned)]
  problems += [f'unexpected {n}' for n in sorted(owned - set(expected))]
  tensors = {}
  for name in sorted(set(expected) & owned):
    tensors[name] = ckpt.tensor(name)
    if tuple(tensors[name].shape) != expected[name]:
      problems.append(f'{name} has shape {tuple(tensors[name].shape)}, the model '
                      f'{expected[name]}')
  if problems:
    raise UserError(f'{path} does not fit a {family} model of {model}: ' + '; '.join(problems))
  flat = keymap.to_ours(rules, tensors.__getitem__, model['num_heads'])
  params = tree_lib.unflatten({p: x.astype(dtype) for p, x in flat.items()})
  tree_lib.check_finite(params, path)
  return params, model


def _our_shapes(fam: Family, model: dict) -> dict[str, tuple[int, ...]]:
  """{path: shape} of the module `model` describes, without allocating it."""
  module = fam.build(ml_collections.ConfigDict(model))
  params = jax.eval_shape(module.init, jax.random.PRNGKey(0), *fam.example_inputs(model))
  return {p: tuple(x.shape) for p, x in tree_lib.flatten(params['params']).items()}


def export(directory: str, params: Any, model: dict, family: str, *,
           shard_bytes: int = 2 * 1024**3) -> None:
  """Writes params as a Hugging Face directory of `family` that transformers loads."""
  fam = registry.lookup(FAMILIES, family, 'model family')
  if fam.hf_config is None:
    raise UserError(f'{family} models are not written here; export the same params as '
                    f'{family.replace("open_clip_", "clip_")}, the Hugging Face layout')
  tensors = keymap.to_theirs(keymap.expand(fam.rules, model['depth']), tree_lib.flatten(params))
  save(directory, tensors, fam.hf_config(model), shard_bytes=shard_bytes,
       extra_configs=fam.extra_configs(model))


def save(directory: str, tensors: dict[str, np.ndarray], config: dict, *,
         shard_bytes: int, extra_configs: dict[str, dict] | None = None) -> None:
  """config.json (and any `extra_configs`, by file name) and the tensors in safetensors shards
  of at most `shard_bytes` (a tensor larger than that gets a shard of its own), with the index
  when there are several; written beside `directory` and put in place of what was there in one
  step (`atomic.directory`)."""
  arrays = {name: np.asarray(tensors[name]) for name in sorted(tensors)}
  shards = safetensors_io.plan_shards([(n, x.shape, x.dtype) for n, x in arrays.items()],
                                      shard_bytes)
  with atomic.directory(directory) as tmp:
    for shard in shards:
      safetensors_io.write(os.path.join(tmp, shard.file), shard.entries,
                           lambda name: [arrays[name]], metadata=PT_METADATA)
    safetensors_io.write_index(tmp, shards)
    for name, content in {'config.json': config, **(extra_configs or {})}.items():
      atomic.write_json(os.path.join(tmp, name), content)
