"""What a checkpoint merge does, checked whole before anything is read or written."""

import dataclasses
import functools
import json
import math
from typing import Any

import ml_dtypes
import numpy as np

import merging
from editing.errors import UserError
from editing import settings as settings_lib
from merging.checkpoints import extraction
from merging.checkpoints import layered

# Beside the data-free merges: θ0 − λ·τ_1, τ_1 itself, and τ_1 as a LoRA adapter
# (`extraction`), of one fine-tuned model.
SINGLE_MODEL = ('negation', 'extract', 'extract_lora')
OUTPUT_DTYPES = {'float32': np.dtype(np.float32), 'bfloat16': np.dtype(ml_dtypes.bfloat16),
                 'float16': np.dtype(np.float16)}


def methods() -> tuple[str, ...]:
  """The methods a checkpoint merge runs: the data-free ones of `merging` (those in LoRA space
  merge PEFT adapters), and SINGLE_MODEL."""
  return tuple(n for n, m in merging.REGISTRY.items() if m.data_free) + SINGLE_MODEL


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
  seed: int = 0  # DARE's key
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
                        f' checkpoint merging runs only the data-free methods {known}')
      raise UserError(f'config.method = {self.method!r} is not a checkpoint merge; known: {known}')
    settings = dict(self.settings)
    if self.method == 'extract_lora':
      settings = settings_lib.check(extraction.options, settings, 'config.extract_lora')
    elif self.method in SINGLE_MODEL:
      if settings:
        raise UserError(f'config.{self.method} takes no settings, got {sorted(settings)}')
    else:
      settings = merging.check_settings(self.method, settings, f'config.{self.method}')
    object.__setattr__(self, 'settings', settings)
    if not _is_number(self.scale) or not math.isfinite(self.scale):
      raise UserError(f'config.scale = {self.scale!r}: must be a finite number')
    if not _is_integer(self.seed) or self.seed < 0:
      raise UserError(f'config.seed = {self.seed!r}: must be an integer ≥ 0')
    if not _is_integer(self.shard_bytes) or self.shard_bytes < 1:
      raise UserError(f'config.shard_bytes = {self.shard_bytes!r}: must be a positive integer')
    if not _is_integer(self.prefetch) or self.prefetch < 1:
      raise UserError(f'config.prefetch = {self.prefetch!r}: must be an integer ≥ 1')
    if self.allow_nonfinite and (self.ranked or self.global_ties):
      raise UserError(f'config.allow_nonfinite: {self.method} ranks magnitudes, and a NaN has '
                      'no rank; it cannot allow non-finite inputs')
    if self.weights is not None:
      if self.method in SINGLE_MODEL or not merging.get(self.method).weighted:
        weighted = [n for n, m in merging.REGISTRY.items() if m.data_free and m.weighted]
        raise UserError(f'config.weights: {self.method} takes no per-model weights; the '
                        f'methods that do: {weighted}')
      if not all(_is_number(w) and math.isfinite(w) for w in self.weights) or \
          not any(self.weights):
        raise UserError(f'config.weights = {list(self.weights)}: must be finite numbers, not all '
                        'zero')
    self._check_per_model()
    self._check_layered()
    if self.dtype is not None and self.dtype not in OUTPUT_DTYPES:
      raise UserError(f'config.dtype = {self.dtype!r}: the output can be written in one of '
                      f'{sorted(OUTPUT_DTYPES)}')

  def _check_per_model(self) -> None:
    """Each setting given per model is one the method takes so, every value valid."""
    if not self.per_model:
      return
    allowed = () if self.method in SINGLE_MODEL else merging.get(self.method).per_vector
    for setting, values in self.per_model:
      if setting not in allowed:
        raise UserError(f'config.per_model.{setting}: {self.method} takes '
                        f'{list(allowed) or "no setting"} per model')
      for i, value in enumerate(values):
        merging.check_settings(self.method, {**self.settings, setting: value},
                               f'config.per_model[{i}]')

  def model_setting(self, setting: str, model: int) -> Any:
    """Setting `setting` of fine-tuned model `model`: its own where given per model."""
    own = dict(self.per_model).get(setting)
    return self.settings[setting] if own is None else own[model]

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
    if self.layered and self.global_ties:
      raise UserError('config.layered: a TIES ranking over the whole model (scope global) '
                      'takes one density; give scope=tensor')

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
  def ranked(self) -> bool:
    """Whether each tensor's magnitudes are ranked whole before its blocks merge."""
    return self.method not in SINGLE_MODEL and merging.get(self.method).ranked

  @property
  def whole_tensor(self) -> bool:
    """Whether each tensor is merged whole (an SVD, a cosine; DARE unless `dare_in_blocks`)."""
    if self.method == 'dare':
      return not self.dare_in_blocks
    return self.method not in SINGLE_MODEL and merging.get(self.method).whole_tensor

  @property
  def dare_in_blocks(self) -> bool:
    """DARE followed by task arithmetic, or by TIES keeping every entry (mergekit's dare_ties),
    everywhere: its merge of an entry reads that entry of each input, a block's draws are its
    own (`ops.kept_entries`), and an L1 rescale needs only the tensor's two norms, so it merges
    a block at a time. TIES at a lower density ranks the dropped tensor whole."""
    if self.method != 'dare' or any(f.split('.')[0] == 'density' for f, _ in self.layered):
      return False
    densities = [self.settings['density'], *dict(self.per_model).get('density', ())]
    return self.settings['then'] == 'task_arithmetic' or all(d == 1 for d in densities)

  @property
  def elementwise(self) -> bool:
    """Whether the merge of an entry reads only that entry of each input (not so for DARE
    rescaled to each tensor's L1 norm, a sum over the tensor)."""
    if self.method in SINGLE_MODEL:
      return True
    l1_rescaled = self.method == 'dare' and self.settings['rescale'] == 'l1_norm'
    return merging.get(self.method).elementwise and not l1_rescaled

  @property
  def global_ties(self) -> bool:
    """TIES (alone or after DARE) ranking each model's magnitudes as a whole: its select's passes
    come first."""
    ties_follows = self.method == 'ties' or (self.method == 'dare' and
                                             self.settings['then'] == 'ties')
    return ties_follows and self.settings['scope'] == 'global'

  def output_dtype(self, base_dtype: np.dtype) -> np.dtype:
    """The dtype a floating tensor is written in: τ in float32, merged weights in the plan's
    dtype, else the base's."""
    if self.method == 'extract':
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
