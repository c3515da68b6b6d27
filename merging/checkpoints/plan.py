"""What a checkpoint merge does, checked whole before anything is read or written."""

import dataclasses
import functools
import itertools
import json
import math
from typing import Any, Iterator

import ml_dtypes
import numpy as np

import merging
from editing.errors import UserError
from editing import settings as settings_lib
from merging import sparsity as sparsity_lib
from merging.checkpoints import calibrated
from merging.checkpoints import extraction
from merging.checkpoints import layered

# Beside the data-free merges of `merging`, the jobs of one fine-tuned model that write no
# merged weights, with the declarations of their settings: τ_1 as a LoRA adapter.
_BESIDE = {'extract_lora': extraction.options}
SINGLE_MODEL = tuple(_BESIDE)
OUTPUT_DTYPES = {'float32': np.dtype(np.float32), 'bfloat16': np.dtype(ml_dtypes.bfloat16),
                 'float16': np.dtype(np.float16)}


def methods() -> tuple[str, ...]:
  """The methods a checkpoint merge runs: the data-free ones of `merging` (those in LoRA space
  merge PEFT adapters), the data-driven ones of decoders on calibration text (`calibrated`),
  and SINGLE_MODEL."""
  return (tuple(n for n, m in merging.REGISTRY.items() if m.data_free) + calibrated.METHODS +
          SINGLE_MODEL)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a merge does: the method and its settings, λ and the output's form.

  Each field is the config key of the same name (configs/merge_checkpoints.py), and the errors
  name it. `settings` may give some of the method's settings; the plan holds all of them, the
  others at the defaults the method declares.
  """

  method: str
  settings: dict
  scale: float = 1.0  # λ
  seed: int = 0  # the key of the method's random draws
  shard_bytes: int = 2 * 1024**3
  allow_nonfinite: bool = False
  weights: tuple[float, ...] | None = None  # per fine-tuned model, in order
  dtype: str | None = None  # of the merged floating tensors; default the base's
  # Blocks read and merged ahead, each in a thread, while one is written: more is faster up
  # to the cores there are. It changes no bit of the output.
  prefetch: int = 2
  # (setting, values) pairs of the settings given one value per fine-tuned model, in order
  # (mergekit's per-model density), where the method takes them (`Method.per_vector`).
  per_model: tuple[tuple[str, tuple], ...] = ()
  # (field, value) pairs whose value varies by tensor (`layered`): a setting of the method,
  # 'scale', 'weights.<i>' (model i's weight) or '<setting>.<i>' (model i's of per_model);
  # the fields above hold the values where no filter matches.
  layered: tuple[tuple[str, Any], ...] = ()

  def __hash__(self):  # a static argument of the jitted per-block merge
    return self._hash

  @functools.cached_property
  def _hash(self) -> int:  # once: the merge hashes the plan at every block
    return hash(tuple(json.dumps(v, sort_keys=True) if isinstance(v, (dict, tuple)) else v
                      for v in dataclasses.astuple(self)))

  def __post_init__(self):
    known = methods()
    if self.method not in known:
      entry = merging.REGISTRY.get(self.method)
      if entry is not None:
        raise UserError(f'config.method = {self.method!r} reads data ({", ".join(entry.reads)});'
                        f' checkpoint merging runs {known}')
      raise UserError(f'config.method = {self.method!r} is not a checkpoint merge; known: {known}')
    where = f'config.{self.method}'
    settings = (settings_lib.check(_BESIDE[self.method], self.settings, where)
                if self.method in _BESIDE else
                merging.check_settings(self.method, self.settings, where))
    object.__setattr__(self, 'settings', settings)
    if not _is_number(self.scale) or not math.isfinite(self.scale):
      raise UserError(f'config.scale = {self.scale!r}: must be a finite number')
    if not _is_integer(self.seed) or self.seed < 0:
      raise UserError(f'config.seed = {self.seed!r}: must be an integer ≥ 0')
    if not _is_integer(self.shard_bytes) or self.shard_bytes < 1:
      raise UserError(f'config.shard_bytes = {self.shard_bytes!r}: must be a positive integer')
    if not _is_integer(self.prefetch) or self.prefetch < 1:
      raise UserError(f'config.prefetch = {self.prefetch!r}: must be an integer ≥ 1')
    if self.weights is not None:
      if self.entry is None or not self.entry.weighted:
        weighted = [n for n, m in merging.REGISTRY.items() if m.data_free and m.weighted]
        raise UserError(f'config.weights: {self.method} takes no per-model weights; the '
                        f'methods that do: {weighted}')
      if not all(_is_number(w) and math.isfinite(w) for w in self.weights) or \
          not any(self.weights):
        raise UserError(f'config.weights = {list(self.weights)}: must be finite numbers, not all '
                        'zero')
    self._check_per_model()
    self._check_layered()
    if self.allow_nonfinite and self.ranked:
      raise UserError(f'config.allow_nonfinite: {self.method} ranks magnitudes, and a NaN has '
                      'no rank; it cannot allow non-finite inputs')
    if self.dtype is not None and self.dtype not in OUTPUT_DTYPES:
      raise UserError(f'config.dtype = {self.dtype!r}: the output can be written in one of '
                      f'{sorted(OUTPUT_DTYPES)}')

  def _check_per_model(self) -> None:
    """Each setting given per model is one the method takes so, every value valid."""
    if not self.per_model:
      return
    allowed = () if self.entry is None else self.entry.per_vector
    for setting, values in self.per_model:
      if setting not in allowed:
        raise UserError(f'config.per_model.{setting}: {self.method} takes '
                        f'{list(allowed) or "no setting"} per model')
      for i, value in enumerate(values):
        merging.check_settings(self.method, {**self.settings, setting: value},
                               f'config.per_model[{i}]')

  def model_setting(self, setting: str, model: int) -> Any:
    """Setting `setting` of fine-tuned model `model`: its own where given per model."""
    return self.model_settings(model)[setting]

  def model_settings(self, model: int) -> dict:
    """Every setting of fine-tuned model `model`: its own where given per model (a count
    of values that is not the models' is refused by the merge)."""
    return {**self.settings,
            **{k: values[model] for k, values in self.per_model if model < len(values)}}

  def _check_layered(self) -> None:
    """Each varying value names a field the plan has, and every value it names is valid."""
    for field, spec in self.layered:
      where = f'config.layered.{field}'
      layered.check(spec, where)
      values = list(layered.anchors(spec))
      if field == 'scale':
        if not all(_is_number(v) and math.isfinite(v) for v in values):
          raise UserError(f'{where} = {spec!r}: λ must be finite numbers')
      elif field.startswith('weights.'):
        index = field[len('weights.'):]
        if self.weights is None or not index.isdigit() or int(index) >= len(self.weights):
          raise UserError(f'{where}: no such model weight (weights: {self.weights})')
        if not all(_is_number(v) and math.isfinite(v) for v in values):
          raise UserError(f'{where} = {spec!r}: weights must be finite numbers')
      elif field.rpartition('.')[0] in dict(self.per_model):
        setting, _, index = field.rpartition('.')
        if not index.isdigit() or int(index) >= len(dict(self.per_model)[setting]):
          raise UserError(f'{where}: no such model of per_model.{setting}')
        for value in values:
          merging.check_settings(self.method, {**self.settings, setting: value},
                                 'config.layered')
      elif field in self.settings:
        for value in values:
          merging.check_settings(self.method, {**self.settings, field: value}, 'config.layered')
      else:
        raise UserError(f'{where}: {self.method} has no setting {field!r}; varying values may '
                        f'be given to {sorted(self.settings) + ["scale", "weights.<i>"]}')
    if self.layered and self.global_cut:
      raise UserError(f'config.layered: {self.method} ranks each model\'s magnitudes over the '
                      'whole model (scope global), one count per model; give scope=tensor')

  def at(self, name: str, t: float) -> 'Plan':
    """The plan of the tensor `name` at layer position t (`layered`): every varying value
    resolved."""
    if not self.layered:
      return self
    settings, scale = dict(self.settings), self.scale
    weights = list(self.weights) if self.weights is not None else None
    per_model = {k: list(v) for k, v in self.per_model}
    for field, spec in self.layered:
      value = layered.resolve(spec, name, t)
      if value is None:
        continue
      setting, _, index = field.rpartition('.')
      if field == 'scale':
        scale = value
      elif setting == 'weights':
        weights[int(index)] = value
      elif setting in per_model:
        per_model[setting][int(index)] = value
      else:
        settings[field] = value
    return dataclasses.replace(self, settings=settings, scale=scale, layered=(),
                               weights=None if weights is None else tuple(weights),
                               per_model=tuple((k, tuple(v)) for k, v in per_model.items()))

  @property
  def entry(self) -> merging.Method | None:
    """The method's entry of `merging.REGISTRY`; None for a job beside them (SINGLE_MODEL)."""
    return None if self.method in _BESIDE else merging.get(self.method)

  def sparsity(self, model: int) -> sparsity_lib.Sparsity:
    """What the method keeps of fine-tuned model `model`'s vector, as it declares it (nothing
    dropped where it declares nothing)."""
    declared = self.entry and self.entry.sparsity
    return declared(**self.model_settings(model)) if declared else sparsity_lib.Sparsity()

  @functools.cached_property
  def _sparsities(self) -> tuple[sparsity_lib.Sparsity, ...]:
    """Every sparsity a vector of a tensor may get: at the plan's settings and at each model's,
    under every combination of the values the varying fields give them."""
    declared = self.entry and self.entry.sparsity
    return tuple(declared(**settings) for settings in self._variants()) if declared else ()

  def _variants(self) -> Iterator[dict]:
    """The plan's settings and each model's, with each combination of the values `layered`
    names for them (an interval's ends bound what it resolves to between them)."""
    models = max((len(values) for _, values in self.per_model), default=0)
    varying = []  # (setting, the model it is of or None for all, its values)
    for field, spec in self.layered:
      setting, _, index = field.rpartition('.')
      if field in self.settings:
        varying.append((field, None, list(layered.anchors(spec))))
      elif setting in dict(self.per_model):
        varying.append((setting, int(index), list(layered.anchors(spec))))
    for model in [None, *range(models)]:
      settings = self.settings if model is None else self.model_settings(model)
      own = [v for v in varying if v[1] is None or v[1] == model]
      for values in itertools.product(*[v[2] for v in own]):
        yield {**settings, **{v[0]: value for v, value in zip(own, values)}}

  @property
  def ranked(self) -> bool:
    """Whether the method cuts each model's ranked magnitudes (`sparsity.Cut`)."""
    return any(s.cut is not None for s in self._sparsities)

  @property
  def global_cut(self) -> bool:
    """Whether it ranks each model's magnitudes over the whole model: a ranking's passes come
    first."""
    return any(s.cut is not None and s.cut.scope == 'global' for s in self._sparsities)

  @property
  def draws(self) -> bool:
    """Whether the method drops entries at random (`sparsity.Draw`)."""
    return any(s.draw is not None for s in self._sparsities)

  @property
  def whole_tensor(self) -> bool:
    """Whether each tensor is merged whole, op by op: the method reads a tensor whole (an SVD)
    where no pass of sums or scores over its blocks serves, or it ranks what its draws left, which the merge of the whole tensor draws and
    ranks as the in-memory merge does. Decided for the whole model, whatever varies by layer."""
    return self.entry is not None and (self.entry.whole_tensor and self.sums is None
                                       and self.entry.scores is None or any(
        s.draw is not None and s.cut is not None for s in self._sparsities))

  @property
  def sums(self):
    """What the method sums over each tensor's blocks before merging them (`merging.Method`),
    or None."""
    return self.entry.sums(**self.settings) if self.entry and self.entry.sums else None

  @property
  def scores(self):
    """What the method ranks each tensor's entries by before its sums (`merging.Method`), or
    None."""
    return self.entry.scores(**self.settings) if self.entry and self.entry.scores else None

  @property
  def elementwise(self) -> bool:
    """Whether the merge of an entry reads only that entry of each input (not so for draws
    rescaled to each tensor's L1 norm, a sum over the tensor, or ranked in their rows)."""
    return self.entry is None or self.entry.elementwise and not any(
        s.draw is not None and (s.draw.norms or s.draw.rows) for s in self._sparsities)

  @property
  def rows(self) -> bool:
    """Whether an entry's draw reads its whole row: a block holds whole rows."""
    return any(s.draw is not None and s.draw.rows for s in self._sparsities)

  def output_dtype(self, base_dtype: np.dtype) -> np.dtype:
    """The dtype a floating tensor is written in: τ in float32, merged weights in the plan's
    dtype, else the base's."""
    if self.entry is not None and self.entry.writes == 'delta':
      return np.dtype(np.float32)
    return OUTPUT_DTYPES[self.dtype] if self.dtype else np.dtype(base_dtype)

  def record(self) -> dict[str, Any]:
    """What the output's bits depend on, as JSON: a partial output resumes only under it."""
    fields = dataclasses.asdict(self)
    del fields['prefetch']
    fields['weights'] = None if self.weights is None else list(self.weights)
    fields['layered'] = json.loads(json.dumps(self.layered))
    fields['per_model'] = json.loads(json.dumps(self.per_model))
    return fields


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
