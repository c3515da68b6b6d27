"""One merge, described whole: what `configs/merge_checkpoints.py`'s flags and a mergekit YAML
both say, typed (mergekit's MergeConfiguration, in this project's terms).

  recipe = Recipe.from_flags(config)              # --config.method=ties --config.weights=...
  recipe = Recipe.from_mergekit('merge.yaml')     # the same merge from a mergekit recipe
  plan = recipe.plan()                            # what the streamed merge does per tensor

The same merge given either way is the same Recipe. Structured flags (per-model values,
layered values, slices) are written in mergekit's own notation, YAML's flow style:

  --config.per_model='{density: [0.2, 0.4]}'      # one value per model, in order
  --config.layered='{t: [0, 0.5, 1], weights.1: [{filter: mlp, value: 0.5}, {value: 0}]}'
  --config.slices='[{/m/base: [0, 16], /m/a: [0, 16]}]'

Fields:
  base, models: the base checkpoint and the fine-tuned ones, in order (passthrough: none).
  method: a checkpoint merge of `merging.checkpoints.methods()`, or 'passthrough'.
  settings: every setting of the method (the rest at the method's declared defaults).
  per_model: {setting: (one value per model)} where the method takes it per vector.
  layered: {field: spec} of values that vary by tensor (`merging.checkpoints.layered`): a
    setting, 'scale', 'weights.<i>' or '<setting>.<i>' of a per-model one.
  slices: per slice, {model: [first layer, end layer]}: the layer ranges merged into the
    output's layers (passthrough: one model a slice, stacked), or None.
  weights: one per model (mergekit's weight), or None.
  scale: λ (passthrough: each tensor's factor).
  seed: the key of random methods' draws, per tensor name (mergekit's --random-seed).
  dtype: of the output's floating tensors, or None for the base's.
  tokenizer: for a merge, the vocabulary the output takes and every model's embedding rows are
    aligned to ('base', 'union' or a checkpoint: `merging.checkpoints.vocabulary`), or None
    (the base's, every model's being the same); for a passthrough, the checkpoint whose
    tokenizer files the output takes (None: the first slice's model's).
  pad_to_multiple_of: the aligned matrices' rows padded to a multiple of it (0: none).
  output, overwrite, shard_bytes, prefetch, allow_nonfinite: how the output is written.
  mergekit_yaml: the recipe's YAML text, recorded in the output's card (not compared).
"""

import dataclasses
from typing import Any, Mapping

import yaml

from editing.errors import UserError
from merging.checkpoints import plan as plan_lib
from merging.mergekit import reader

PASSTHROUGH = 'passthrough'


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A merge: its inputs, method, values and output (the module's docstring)."""

  base: str
  models: tuple[str, ...]
  method: str
  settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  per_model: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  layered: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  slices: tuple[Mapping[str, list], ...] | None = None
  weights: tuple[float, ...] | None = None
  scale: float = 1.0
  seed: int = 0
  dtype: str | None = None
  tokenizer: str | None = None
  pad_to_multiple_of: int = 0
  output: str = ''
  overwrite: bool = False
  shard_bytes: int = 2 * 1024**3
  prefetch: int = 2
  allow_nonfinite: bool = False
  mergekit_yaml: str | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    object.__setattr__(self, 'models', tuple(self.models))
    object.__setattr__(self, 'per_model', {k: tuple(v) for k, v in self.per_model.items()})
    if self.weights is not None:
      object.__setattr__(self, 'weights', tuple(self.weights))
    if self.slices is not None:
      object.__setattr__(self, 'slices', tuple(self.slices))
    if isinstance(self.pad_to_multiple_of, bool) or not isinstance(
        self.pad_to_multiple_of, int) or self.pad_to_multiple_of < 0:
      raise UserError(f'config.pad_to_multiple_of = {self.pad_to_multiple_of!r} must be an '
                      'integer ≥ 0')
    if self.method == PASSTHROUGH:
      if not self.slices:
        raise UserError('config.slices: passthrough stacks slices; give at least one')
      if self.tokenizer in ('base', 'union') or self.pad_to_multiple_of:
        raise UserError(f'config.tokenizer = {self.tokenizer}: a passthrough takes one model\'s '
                        'tokenizer files, named by its path; a union or alignment is built for '
                        'merges only')
      return
    if not self.base:
      raise UserError('config.base: give the base checkpoint (a Hugging Face directory or a '
                      '.safetensors file)')
    object.__setattr__(self, 'settings', self.plan().settings)  # checked, defaults filled

  @classmethod
  def from_flags(cls, config) -> 'Recipe':
    """The merge `configs/merge_checkpoints.py`'s flags describe, every value checked."""
    section = config.get(config.method)
    is_section = section is not None and hasattr(section, 'to_dict')
    return cls(
        base=config.base, models=tuple(m.strip() for m in config.models.split(',')
                                       if m.strip()),
        method=config.method, settings=section.to_dict() if is_section else {},
        per_model=_per_model(config.per_model), layered=_mapping(config.layered, 'layered'),
        slices=_slices(config.slices), weights=_weights(config), scale=config.scale,
        dtype=config.dtype or None, tokenizer=config.tokenizer or None,
        pad_to_multiple_of=config.pad_to_multiple_of, **options(config))

  @classmethod
  def from_mergekit(cls, path: str, config=None) -> 'Recipe':
    """The merge of the mergekit YAML at `path` (`merging.mergekit.reader`); the options a
    YAML does not hold (seed, output, ...) from `config` where given."""
    return cls(**reader.read(path), **(options(config) if config is not None else {}))

  def plan(self) -> plan_lib.Plan:
    """What the streamed merge does per tensor."""
    if self.method == PASSTHROUGH:
      raise ValueError('a passthrough stacks slices; it has no merge plan')
    return plan_lib.Plan(
        self.method, dict(self.settings), scale=self.scale, seed=self.seed,
        shard_bytes=self.shard_bytes, allow_nonfinite=self.allow_nonfinite,
        weights=self.weights, dtype=self.dtype, prefetch=self.prefetch,
        per_model=tuple(sorted(self.per_model.items())),
        layered=tuple(sorted(self.layered.items())))


def options(config) -> dict[str, Any]:
  """The recipe's fields a mergekit YAML does not hold, from the flags."""
  return dict(seed=config.seed, output=config.output, overwrite=config.overwrite,
              shard_bytes=config.shard_bytes, prefetch=config.prefetch,
              allow_nonfinite=config.allow_nonfinite)


def _parsed(text: str, key: str) -> Any:
  """Flag `key`'s value, in YAML's flow notation; None where it is empty."""
  if not text.strip():
    return None
  try:
    return yaml.safe_load(text)
  except yaml.YAMLError as e:
    raise UserError(f'config.{key} = {text!r} is not YAML ({" ".join(str(e).split())})') \
        from None


def _mapping(text: str, key: str) -> dict:
  value = _parsed(text, key)
  if value is None:
    return {}
  if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
    raise UserError(f'config.{key} = {text!r}: a mapping {{field: value}}')
  return value


def _per_model(text: str) -> dict[str, tuple]:
  value = _mapping(text, 'per_model')
  if not all(isinstance(v, list) for v in value.values()):
    raise UserError(f'config.per_model = {text!r}: a mapping {{setting: [one value per '
                    'model]}')
  return value


def _slices(text: str) -> tuple[dict, ...] | None:
  value = _parsed(text, 'slices')
  if value is None:
    return None
  if not isinstance(value, list) or not all(isinstance(s, dict) for s in value):
    raise UserError(f'config.slices = {text!r}: a list of {{model: [first layer, end layer]}}, '
                    'one mapping per slice')
  return tuple(value)


def _weights(config) -> tuple[float, ...] | None:
  """config.weights: comma-separated numbers, refused where a normalized task arithmetic
  would divide by their zero sum."""
  if not config.weights.strip():
    return None
  try:
    weights = tuple(float(w) for w in config.weights.split(','))
  except ValueError:
    raise UserError(f'config.weights = {config.weights!r}: comma-separated numbers, one per '
                    'model') from None
  normalized = config.method == 'task_arithmetic' and config.task_arithmetic.normalize
  varying = any(f.startswith('weights.') for f in _mapping(config.layered, 'layered'))
  if normalized and not varying and sum(weights) == 0:
    raise UserError(f'config.weights = {config.weights!r} sum to 0, and task_arithmetic with '
                    'normalize divides by their sum')
  return weights
