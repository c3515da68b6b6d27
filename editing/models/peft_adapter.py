"""PEFT LoRA adapters in and out: adapter_config.json plus adapter_model.safetensors.

An adapter over a Hugging Face model of a family (`editing.models.hf.FAMILIES`), or over a
causal LM that the decoder reads (`third_party.hf_decoder`, its model given by its
DecoderConfig), is read as a LoRA task vector: each `base_model.model.<module>.lora_A.weight`
(r × inputs) and `lora_B` (outputs × r) becomes the `LowRank` of the kernel whose weight is
`<module>.weight` in the model's key map, with PEFT's scale α/r (α/√r under use_rslora; a
module's own r and α from rank_pattern and alpha_pattern). PyTorch's (outputs, inputs) is the
order `LowRank` keeps, so the factors are read and written as they are stored: reading an
adapter and writing it back gives the same bytes. So are attention heads: a query, key or value
kernel (in, heads, dim) is the weight (heads·dim, in) transposed, the output kernel
(heads, dim, out) the weight (out, heads·dim) transposed (`editing.lora.matrix_shape`).

Refused, each by name: a pickled adapter (adapter_model.bin), another PEFT type, DoRA
(use_dora), LoRA biases (lora_bias), fan_in_fan_out, PEFT's other LoRA variants and settings
that change the model beyond W + s·B A (`_REFUSED`), embedding LoRA, `modules_to_save` (whole
modules the task vector would have to hold densely), factors of a module its `target_modules`
do not match (PEFT would not load them), a module the model's key map does not know or lays
out in parts (nor is a LowRank of such a leaf written), factors whose shapes do not fit the
base, and an adapter written here for another base (its fingerprint, in the file's metadata).

In a checkpoint merge an adapter directory stands for its fine-tuned model (`Adapted`: the
base with the adapter merged in), and LoRA-space merges read the adapters' factors alone.
"""

import json
import math
import os
import re
import threading
from typing import NamedTuple

import numpy as np

from editing import atomic
from editing import safetensors_io
from editing import tree as tree_lib
from editing.errors import UserError
from editing.lora import PREFIX, LowRank, lora_keys
from editing.models import keymap
from editing.models.decoder_config import DecoderConfig
from editing.task_vector import TaskVector
from third_party import hf_decoder

ADAPTER = 'adapter_model.safetensors'
CONFIG = 'adapter_config.json'
PT_METADATA = {'format': 'pt'}
ALL_LINEAR = 'all-linear'  # PEFT's target_modules for every linear layer
_BASE_KEY = 'editmerge_base'
_LAYOUTS = ('linear', 'heads_in', 'heads_out')  # those whose ΔK is (B A)ᵀ reshaped
# Settings under which PEFT's model is not W + s·B A on the adapted layers alone: its layers
# compute something else (DoRA and the other variants), or the model around them changes.
_REFUSED = (('use_dora', 'DoRA'), ('lora_bias', 'LoRA biases'),
            ('fan_in_fan_out', 'fan_in_fan_out (GPT-2 style Conv1D)'),
            ('alora_invocation_tokens', 'activated LoRA (aLoRA)'),
            ('use_bdlora', 'block-diagonal LoRA'), ('arrow_config', 'Arrow routing'),
            ('velora_config', 'VeLoRA'), ('monteclora_config', 'MonteCLoRA'),
            ('kasa_config', 'KaSA'), ('layer_replication', 'layer replication'),
            ('target_parameters', 'LoRA on parameters (target_parameters)'),
            ('trainable_token_indices', 'trainable tokens'))


def config(*, rank: int, alpha: float, target_modules, base_path: str,
           rank_pattern: dict | None = None, alpha_pattern: dict | None = None,
           modules_to_save=None, rslora: bool = False, task_type: str | None = None) -> dict:
  """The adapter_config.json of a LoRA adapter PEFT loads; `task_type` chooses the PeftModel
  class that PeftModel.from_pretrained returns (CAUSAL_LM: one that generates)."""
  return {'peft_type': 'LORA', 'base_model_name_or_path': base_path, 'r': rank,
          'lora_alpha': alpha, 'rank_pattern': rank_pattern or {},
          'alpha_pattern': alpha_pattern or {}, 'target_modules': sorted(target_modules),
          'modules_to_save': modules_to_save or None, 'lora_dropout': 0.0,
          'fan_in_fan_out': False, 'bias': 'none', 'use_rslora': rslora, 'use_dora': False,
          'inference_mode': True, 'task_type': task_type}


def save(directory: str, tensors: dict, adapter_config: dict, metadata: dict | None = None):
  """The adapter's two files, into `directory`."""
  safetensors_io.save(os.path.join(directory, ADAPTER), tensors,
                      {**PT_METADATA, **(metadata or {})})
  atomic.write_json(os.path.join(directory, CONFIG), adapter_config)


def _pattern(patterns: dict, module: str):
  """PEFT's rank_pattern / alpha_pattern lookup: the first key the module's name ends with."""
  for key, value in patterns.items():
    if re.match(rf'(.*\.)?({key})$', module):
      return value
  return None


def _matches(spec, module: str) -> bool:
  """PEFT's match of a module name: a string is a regex the whole name matches, a list holds
  whole names or their last dotted parts."""
  if isinstance(spec, str):
    return re.fullmatch(spec, module) is not None
  return any(module == name or module.endswith(f'.{name}') for name in spec)


def _check_targets(directory: str, adapter: dict, modules: list[str]) -> None:
  """Refuses factors of a module that PEFT puts no LoRA layer on: one `target_modules` does
  not match, or `exclude_modules` does. PEFT refuses an adapter that targets none of the
  model's modules, and loads one that misses some without their factors.

  'all-linear' targets every linear layer, as every factor read here is; without
  target_modules PEFT takes its defaults for the model's type, which are not known here.
  """
  targets = adapter.get('target_modules')
  if targets is None or targets == ALL_LINEAR:
    return
  excluded = adapter.get('exclude_modules') or []
  missed = [m for m in modules if not _matches(targets, m) or _matches(excluded, m)]
  if not missed:
    return
  path = os.path.join(directory, CONFIG)
  if len(missed) == len(modules):
    raise UserError(f'{path}: target_modules {targets!r} match none of the modules its factors '
                    f'adapt (such as {modules[0]}); PEFT refuses such an adapter')
  raise UserError(f'{path}: target_modules {targets!r} leave out {missed[0]}, whose factors '
                  f'{ADAPTER} holds; PEFT would load the adapter without them')


class _KeyMap(NamedTuple):
  """What reading and writing an adapter needs of a model's key map."""
  rules: dict[str, tuple[str, str]]  # {their weight name: (our path, layout)}
  prefix: str  # in task models' checkpoints only, and stripped (e.g. 'bert.')
  name: str  # the model, in messages
  task_type: str | None  # PEFT's, written into the adapter's config


def _key_map(family, model: dict | None) -> _KeyMap:
  """The key map of an encoder `family` (hf.FAMILIES) of config.model `model`, or of the
  decoder when `family` is its DecoderConfig (and `model` None)."""
  if isinstance(family, DecoderConfig):
    return _KeyMap({theirs: (ours, layout) for ours, theirs, layout in hf_decoder.rules(family)},
                   '', f'{family.model_type} decoder', 'CAUSAL_LM')
  return _KeyMap({theirs: (ours, layout)
                  for ours, theirs, layout in keymap.expand(family.rules, model['depth'])},
                 family.prefix, f'{model} model', None)


def factors(directory: str) -> tuple[dict[str, LowRank], dict[str, str]]:
  """({weight name: its factors}, the file's metadata) of the adapter in `directory`, a
  module's weight named as in the base model's own checkpoint (`<module>.weight`); each
  kernel's shape is its weight's (outputs, inputs) transposed."""
  if os.path.exists(os.path.join(directory, 'adapter_model.bin')) and \
      not os.path.exists(os.path.join(directory, ADAPTER)):
    raise UserError(f'{directory}: adapter_model.bin is a pickle, which is never unpickled '
                    'here; save the adapter with safe_serialization (adapter_model.safetensors)')
  try:
    with open(os.path.join(directory, CONFIG)) as f:
      adapter = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f'{directory}: no readable {CONFIG} ({e})') from None
  if adapter.get('peft_type') != 'LORA':
    raise UserError(f'{directory}: a {adapter.get("peft_type")} adapter; only LoRA is read')
  for key, what in _REFUSED:
    if adapter.get(key):
      raise UserError(f'{directory}: {CONFIG} sets {key}: {what} is not read here')
  if adapter.get('modules_to_save'):
    raise UserError(f'{directory}: modules_to_save {adapter["modules_to_save"]} hold whole '
                    'modules, which a LoRA task vector does not; merge without them')
  tensors, metadata = safetensors_io.load(os.path.join(directory, ADAPTER))
  found = {}
  for name in sorted(tensors):
    if not name.startswith(PREFIX) or not name.endswith(('.lora_A.weight', '.lora_B.weight')):
      raise UserError(f'{directory}: {name} is not a LoRA factor of a linear layer (embedding '
                      'LoRA, biases and saved modules are not read)')
    if name.endswith('.lora_B.weight'):
      continue
    module = name[len(PREFIX):-len('.lora_A.weight')]
    key_a, key_b = lora_keys(module)
    if key_b not in tensors:
      raise UserError(f'{directory}: {key_a} has no {key_b}')
    a, b = tensors[key_a], tensors[key_b]
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
      raise UserError(f'{directory}: {module} has factors A {a.shape} and B {b.shape}, which '
                      'do not multiply')
    rank = _pattern(adapter.get('rank_pattern') or {}, module) or adapter['r']
    alpha = _pattern(adapter.get('alpha_pattern') or {}, module) or adapter['lora_alpha']
    if a.shape[0] != rank:
      raise UserError(f'{directory}: {module} has rank {a.shape[0]}, its config says {rank}')
    scale = alpha / (math.sqrt(rank) if adapter.get('use_rslora') else rank)
    found[module + '.weight'] = LowRank(b, a, np.float32(scale), (a.shape[1], b.shape[0]))
  if not found:
    raise UserError(f'{directory}: {ADAPTER} holds no LoRA factor')
  _check_targets(directory, adapter, [w[:-len('.weight')] for w in found])
  return found, metadata


def read(directory: str, family, model: dict | None, theta0) -> TaskVector:
  """The LoRA task vector of the adapter in `directory` over θ0: a `family` model of `model`,
  or the decoder of `family`, its DecoderConfig (`model` None)."""
  found, metadata = factors(directory)
  base = tree_lib.fingerprint(theta0)
  if metadata.get(_BASE_KEY, base) != base:
    raise UserError(f'{directory}: the adapter was written for the base {metadata[_BASE_KEY]}, '
                    f'and this base is {base}')
  names, shapes = _key_map(family, model), tree_lib.flatten(theta0)
  delta = {}
  for weight, f in found.items():
    ours = weight[len(names.prefix):] if names.prefix and weight.startswith(names.prefix) \
        else weight
    if ours not in names.rules or names.rules[ours][1] not in _LAYOUTS:
      raise UserError(f'{directory}: {weight[:-len(".weight")]} is not a linear layer of a '
                      f'{names.name} that its key map reads whole')
    path, layout = names.rules[ours]
    shape = np.shape(shapes[path])
    outputs, inputs = keymap.their_shape(layout, shape)
    if f.a.shape[1] != inputs or f.b.shape[0] != outputs:
      raise UserError(f'{directory}: {weight[:-len(".weight")]} has factors A {f.a.shape} and B '
                      f'{f.b.shape}, and the base layer is {outputs} × {inputs}: an adapter for '
                      'another base')
    delta[path] = f.replace(shape=shape)
  return TaskVector(delta, (os.path.basename(os.path.normpath(directory)),), 'lora', base)


def write(directory: str, vector: TaskVector, family, model: dict | None, *,
          base_path: str = '', theta0=None) -> None:
  """`vector`'s factors as an adapter PEFT loads over the Hugging Face model of `family` and
  `model`, as `read` takes them; with θ0, its fingerprint goes into the file's metadata."""
  if not vector.low_rank:
    raise UserError(f'{vector.tasks}: a dense task vector; factor it first '
                    '(editing.lora.factor) to write it as a LoRA adapter')
  names = _key_map(family, model)
  by_path = {ours: (theirs, layout) for theirs, (ours, layout) in names.rules.items()}
  unnamed = sorted(set(vector.delta) - set(by_path))
  if unnamed:
    raise UserError(f'{unnamed[0]}: the {names.prefix}key map of a {names.name} has no Hugging '
                    'Face name for it')
  # PEFT reads lora_A and lora_B only on linear layers (an embedding's factors have other names).
  unlaid = sorted(p for p in vector.delta if by_path[p][1] not in _LAYOUTS)
  if unlaid:
    raise UserError(f'{unlaid[0]}: not a linear layer ({by_path[unlaid[0]][0]}), so PEFT has no '
                    'LoRA factors of this form for it')
  metadata = {_BASE_KEY: tree_lib.fingerprint(theta0)} if theta0 is not None else {}
  tensors, adapter = tensors_and_config(
      {by_path[p][0][:-len('.weight')]: f for p, f in vector.delta.items()}, base_path,
      task_type=names.task_type)
  with atomic.directory(directory) as tmp:
    save(tmp, tensors, adapter, metadata)


def tensors_and_config(modules: dict[str, LowRank], base_path: str, dtype=np.float32,
                       task_type: str | None = None) -> tuple[dict, dict]:
  """The saved tensors and adapter_config.json of {module: factors}: the most common rank and
  scale give r and lora_alpha (α = s·r), the other modules theirs in rank_pattern and
  alpha_pattern."""
  tensors, ranks, alphas = {}, {}, {}
  for module, f in modules.items():
    key_a, key_b = lora_keys(module)
    tensors[key_a], tensors[key_b] = (np.asarray(x).astype(dtype) for x in (f.a, f.b))
    ranks[module], alphas[module] = f.rank, float(f.scale) * f.rank
  rank = max(set(ranks.values()), key=list(ranks.values()).count)
  alpha = max(set(alphas.values()), key=list(alphas.values()).count)
  return tensors, config(rank=rank, alpha=alpha, base_path=base_path, target_modules=set(ranks),
                         rank_pattern={m: r for m, r in ranks.items() if r != rank},
                         alpha_pattern={m: a for m, a in alphas.items() if a != alpha},
                         task_type=task_type)


def factors_over(base, directory: str) -> dict[str, LowRank]:
  """The factors of the adapter in `directory`, each checked to make a delta of its weight's
  shape in `base` (an hf.Checkpoint): an adapter for another base is refused by name."""
  found, _ = factors(directory)
  for weight, f in found.items():
    if weight not in base.files:
      raise UserError(f'{directory}: adapts {weight}, which {base.path} does not hold')
    shape = tuple(base.header(weight)[0])
    if shape != (f.b.shape[0], f.a.shape[1]):
      raise UserError(f'{directory}: the factors of {weight} make a {f.b.shape[0]} × '
                      f'{f.a.shape[1]} delta, and {base.path} has {shape}: an adapter for '
                      'another base')
  return found


class Adapted:
  """A base checkpoint with an adapter merged into it, read as an `hf.Checkpoint` is: each
  adapted weight is W + s·B A, computed in float32 and stored back in W's dtype (the weights
  PEFT's merge_and_unload makes); every other tensor is the base's."""

  def __init__(self, base, directory: str):
    self.path, self.config, self._base = directory, base.config, base
    self._factors = factors_over(base, directory)
    adapter = os.path.join(directory, ADAPTER)
    self.files = {n: adapter if n in self._factors else f for n, f in base.files.items()}
    # The blocks of one tensor are read one after another: its adapted weight is made once.
    self._last, self._lock = (None, None), threading.Lock()

  def header(self, name: str):
    return self._base.header(name)

  def tensor(self, name: str) -> np.ndarray:
    if name not in self._factors:
      return self._base.tensor(name)
    with self._lock:
      if self._last[0] != name:
        weight, f = self._base.tensor(name), self._factors[name]
        product = np.asarray(f.b, np.float32) @ np.asarray(f.a, np.float32)
        self._last = (name, (weight.astype(np.float32) + f.scale * product).astype(weight.dtype))
      return self._last[1]

  def read(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    if name not in self._factors:
      return self._base.read(name, start, stop, out)
    entries = self.tensor(name).reshape(-1)[start:stop]
    if out is None:
      return entries.copy()
    out[:stop - start] = entries
    return out


def is_adapter(path: str) -> bool:
  return os.path.isfile(os.path.join(path, CONFIG))
