"""mergekit's YAML recipes, read onto `configs/merge_checkpoints.py`.

  models:                       # the models (an entry naming the base is the base)
    - model: /models/math
      parameters: {weight: 0.6, density: 0.2}
    - model: /models/code
      parameters: {weight: 0.4, density: 0.2}
  merge_method: ties            # any method of METHODS
  base_model: /models/base
  parameters: {normalize: true, lambda: 1.0}   # global; per-model ones may be given here too
  dtype: bfloat16               # of the output (float32, bfloat16, float16)

maps onto the same merges, each with mergekit's own defaults (its generalized task
arithmetic: ties normalizes, dare_ties and dare_linear do not and rescale to each tensor's L1
norm, density 1 keeps everything; `linear` is the normalized weighted task arithmetic
Σ w_t θ_t / Σ w_t = θ0 + Σ w_t τ_t / Σ w_t). mergekit's `--random-seed` is `config.seed`:
DARE's and DELLA's draws are keyed by it and each tensor's name, so a run is reproducible.

Every parameter may vary by tensor as mergekit's do (`merging.checkpoints.layered`): a
gradient over the layers, `t: [0, 0.5, 1]`, or {filter, value} entries per module,
`t: [{filter: self_attn, value: [0, 1]}, {value: 0.5}]`; they become `config.layered`.

Models may give a parameter different values (`config.per_model`) where the method takes it
per vector (TIES' and DELLA's density, DARE's); a model that gives none takes mergekit's
default. A parameter that mergekit knows but ignores for the method (`density` on
task_arithmetic) is accepted with a warning; any other key (slices, tokenizer_source) is named
in the error, never ignored.
"""

import dataclasses
import json
import os
from typing import Any, Callable

import ml_collections
import yaml
from absl import logging

import merging
from editing.errors import UserError
from merging.checkpoints import layered


@dataclasses.dataclass(frozen=True)
class Method:
  """How a mergekit method maps onto one of `merging`.

  Attributes:
    ours: the method of `merging` it runs.
    settings: its settings at mergekit's defaults for this method.
    parameters: the global parameters mergekit reads for it (`lambda` is config.scale).
    model_parameters: the per-model ones (`weight` is config.weights; the others must be the
      same for every model).
    base: 'required' (task vectors against base_model), 'optional' (the task vectors given a
      base_model, else the models' weights: task_space), 'averaged' (the base is one of the
      models averaged, as mergekit's Karcher mean takes every model it is given), or 'none'
      (the models listed are merged, base_model unread: `linear`).
    required: the parameters mergekit requires.
  """

  ours: str
  settings: dict
  parameters: tuple[str, ...] = ()
  model_parameters: tuple[str, ...] = ()
  base: str = 'required'
  required: tuple[str, ...] = ()


def _gta(ours: str, sparsifier: tuple[str, ...], **settings) -> Method:
  """A sparsifying method of mergekit's generalized task arithmetic (normalize, rescale and
  lambda global; weight, density and the sparsifier's own per model)."""
  return Method(ours, settings, ('normalize', 'rescale', 'lambda', 'int8_mask'),
                ('weight', 'density') + sparsifier)


_L1 = {'rescale': 'l1_norm'}
METHODS = {
    'linear': Method('task_arithmetic', {'normalize': True}, ('normalize',), ('weight',),
                     base='none'),
    'task_arithmetic': Method('task_arithmetic', {'normalize': False}, ('normalize', 'lambda'),
                              ('weight',)),
    'ties': _gta('ties', (), normalize=True, scope='tensor', density=1.0),
    'dare_ties': _gta('dare', (), then='ties', density=1.0, scope='tensor', normalize=False,
                      p=0.0, **_L1),
    'dare_linear': _gta('dare', (), then='task_arithmetic', normalize=False, p=0.0, **_L1),
    'breadcrumbs': _gta('breadcrumbs', ('gamma',), elect_sign=False, normalize=False, top=0.0,
                        bottom=0.0),
    'breadcrumbs_ties': _gta('breadcrumbs', ('gamma',), elect_sign=True, normalize=False,
                             top=0.0, bottom=0.0),
    'della': _gta('della', ('epsilon',), elect_sign=True, normalize=True, density=1.0,
                  epsilon=0.15, **_L1),
    'della_linear': _gta('della', ('epsilon',), elect_sign=False, normalize=False,
                         density=1.0, epsilon=0.15, **_L1),
    'sce': Method('sce', {'select_topk': 1.0}, ('select_topk', 'int8_mask')),
    'model_stock': Method('model_stock', {'clip': False}, ('filter_wise',)),
    'slerp': Method('slerp', {}, ('t',), required=('t',)),
    'nuslerp': Method('nuslerp', {'flatten': True, 'row_wise': False},
                      ('nuslerp_flatten', 'nuslerp_row_wise'), ('weight',), base='optional'),
    'multislerp': Method('multislerp', {}, ('normalize_weights',), ('weight',),
                         base='optional'),
    'karcher': Method('karcher', {'max_iter': 10, 'tol': 1e-5, 'task_space': False},
                      ('max_iter', 'tol'), base='averaged'),
}
# Every parameter some method reads: one the recipe's method does not is ignored, with a warning.
_KNOWN = sorted({p for m in METHODS.values() for p in m.parameters + m.model_parameters})
_TOP_KEYS = ('models', 'merge_method', 'base_model', 'parameters', 'dtype')
_MODEL_KEYS = ('model', 'parameters')


def apply(config: ml_collections.ConfigDict, path: str) -> ml_collections.ConfigDict:
  """`config` with the merge of the mergekit YAML at `path` filled in."""
  doc = _read(path)
  _check_keys(doc, _TOP_KEYS, path, '')
  name = doc.get('merge_method')
  if name not in METHODS:
    raise UserError(f'{path}: merge_method {name!r} is not supported here; supported: '
                    f'{sorted(METHODS)}')
  method = METHODS[name]
  given = doc.get('parameters') or {}
  _check_keys(given, _KNOWN, path, 'parameters.')
  base, models = _models(doc, method, path)
  missing = [key for key in method.required if key not in given]
  if missing:
    raise UserError(f'{path}: {name} requires parameters.{", parameters.".join(missing)}')

  per_model = {key: [] for key in method.model_parameters}
  for i, entry in models:
    own = entry.get('parameters') or {}
    where = f'models[{i}].parameters.'
    _check_keys(own, _KNOWN, path, where)
    for key in own:
      if key not in method.model_parameters:
        _ignored(path, where + key, name)
    for key in method.model_parameters:
      if key in own:
        per_model[key].append(_value(own[key], path, where + key))
      elif key in given:
        per_model[key].append(_value(given[key], path, 'parameters.' + key))
      else:
        per_model[key].append(None)  # mergekit's default
  for key in given:
    if key not in method.parameters + method.model_parameters:
      _ignored(path, 'parameters.' + key, name)

  values, differing = {}, {}
  for key, specs in per_model.items():
    if key == 'weight' or all(v is None for v in specs):
      continue
    if len({json.dumps(v) for v in specs}) == 1:
      values[key] = specs[0]
    else:
      differing[key] = specs
  for key in method.parameters:
    if key in given and key != 'lambda':
      values[key] = _value(given[key], path, 'parameters.' + key)
  settings, varying = dict(method.settings), {}
  for key, spec in values.items():
    if method.ours == 'breadcrumbs' and key in ('density', 'gamma'):
      continue
    _place(key, spec, method, path, settings, varying)
  per_model_settings = {}
  for key, specs in differing.items():
    _place_per_model(key, specs, method, path, settings, varying, per_model_settings)
  if method.ours == 'breadcrumbs':
    band = [values.get('density', 1.0), values.get('gamma', 0.01)]
    if not all(isinstance(v, (int, float)) for v in band):
      raise UserError(f'{path}: breadcrumbs takes one density and one gamma here (per-layer '
                      'values of either are not supported)')
    settings.update(_band(*(_number(v, path, k) for v, k in zip(band, ('density', 'gamma')))))
  if method.base == 'optional':
    settings['task_space'] = bool(doc.get('base_model'))

  _check_exists(base, path, 'base_model')
  for i, entry in models:
    _check_exists(entry.get('model'), path, f'models[{i}].model' if i >= 0 else 'base_model')
  out = ml_collections.ConfigDict(config.to_dict())
  out.base, out.method = str(base), method.ours
  out.models = ','.join(str(entry['model']) for _, entry in models)
  weights = per_model.get('weight', [])
  if 'weight' in method.model_parameters and any(w is not None for w in weights):
    if None in weights:
      raise UserError(f'{path}: give every model a weight, or none (parameters.weight for all)')
    out.weights = ','.join(repr(w if isinstance(w, (int, float)) else 1.0) for w in weights)
    varying.update({f'weights.{i}': w for i, w in enumerate(weights)
                    if not isinstance(w, (int, float))})
  else:
    out.weights = ''
  out.scale = 1.0
  if 'lambda' in given and 'lambda' in method.parameters:
    scale = _value(given['lambda'], path, 'parameters.lambda')
    if isinstance(scale, (int, float)):
      out.scale = _number(scale, path, 'parameters.lambda')
    else:
      varying['scale'] = scale
  out.layered = json.dumps(varying) if varying else ''
  out.per_model = json.dumps(per_model_settings) if per_model_settings else ''
  out.dtype = str(doc.get('dtype') or '')
  section = out[method.ours].to_dict() if method.ours in out else {}
  out[method.ours] = ml_collections.ConfigDict({**section, **settings})
  return out


def _read(path: str) -> dict:
  try:
    with open(path) as f:
      doc = yaml.safe_load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f'no mergekit config at {path}') from None
  except yaml.YAMLError as e:
    raise UserError(f'{path} is not valid YAML ({e})') from None
  if not isinstance(doc, dict):
    raise UserError(f'{path}: a mergekit config is a mapping with {_TOP_KEYS}')
  return doc


def _models(doc: dict, method: Method, path: str) -> tuple[str, list[tuple[int, dict]]]:
  """The base checkpoint and the (index, entry) of each model merged against it (index −1:
  the base itself, where it is averaged in)."""
  base = doc.get('base_model')
  entries = list(enumerate(doc.get('models') or []))
  for i, entry in entries:
    _check_keys(entry, _MODEL_KEYS, path, f'models[{i}].')
  if method.base == 'required' and not base:
    raise UserError(f'{path}: base_model is required for {doc["merge_method"]} (it merges '
                    'task vectors against it)')
  if method.base == 'none':
    base = entries[0][1].get('model') if entries else None  # the task vectors' origin alone
  elif method.base == 'averaged':
    listed = [e.get('model') for _, e in entries]
    if base and base not in listed:
      entries.insert(0, (-1, {'model': base}))  # mergekit averages the base model in too
    if entries:
      base = base or entries[0][1].get('model')
  elif base:
    entries = [(i, e) for i, e in entries if e.get('model') != base]
  elif entries:
    base = entries[0][1].get('model')  # the weights' interpolation, against the first model
  if not entries:
    raise UserError(f'{path}: models lists no model to merge')
  count = merging.get(method.ours).vectors
  if count is not None and len(entries) != count:
    raise UserError(f'{path}: {doc["merge_method"]} merges {count} model'
                    f'{"s" if count > 1 else ""} besides the base, got {len(entries)}')
  return base, entries


def _value(raw: Any, path: str, key: str) -> Any:
  """A parameter's value: a number or flag, or per layer and module (`layered`), checked."""
  layered.check(raw, f'{path}: {key}')
  return raw


def _place(key: str, spec: Any, method: Method, path: str, settings: dict,
           varying: dict) -> None:
  """Parameter `key`'s value in `settings`, or, where it varies by tensor, in `varying` as
  the setting it translates to, translated value by value."""
  if layered.is_scalar(spec):
    _TRANSLATE[key](settings, spec, method, path)
    return
  translated = {}

  def one(value):
    placed = {}
    _TRANSLATE[key](placed, value, method, path)
    if len(placed) != 1:
      raise UserError(f'{path}: {key} cannot vary by layer or module here')
    (setting, result), = placed.items()
    translated.setdefault('setting', setting)
    return result

  varying_spec = layered.map_values(spec, one)
  varying[translated['setting']] = varying_spec


def _place_per_model(key: str, specs: list, method: Method, path: str, settings: dict,
                     varying: dict, per_model: dict) -> None:
  """Parameter `key`, different between the models, as the setting it translates to given
  per model (its layered values as '<setting>.<i>'); a model that does not give it takes
  mergekit's default."""
  setting = None
  values = []
  for i, spec in enumerate(specs):
    placed, layered_value = {}, {}
    if spec is not None:
      _place(key, spec, method, path, placed, layered_value)
    if len(placed) + len(layered_value) > 1:
      raise UserError(f'{path}: {key} cannot differ between models here')
    (name, value), = (placed or layered_value or {None: None}).items()
    if name is not None:
      setting = setting or name
    values.append((value, bool(layered_value)))
  if setting is None or setting not in merging.get(method.ours).per_vector:
    raise UserError(f'{path}: the models have different values of {key} ({specs}); '
                    f'{method.ours} takes one {key} for all models')
  per_model[setting] = [settings[setting] if v is None or is_layered else v
                        for v, is_layered in values]
  for i, (value, is_layered) in enumerate(values):
    if is_layered:
      varying[f'{setting}.{i}'] = value


def _density(settings: dict, density: float, method: Method, path: str) -> None:
  """mergekit's density d (the share kept), in each sparsifier's terms (Breadcrumbs': `_band`)."""
  if not 0 < density <= 1:
    raise UserError(f'{path}: density = {density} must be in (0, 1]')
  if method.ours == 'dare':
    settings['p'] = 1.0 - density
  elif method.ours in ('ties', 'della'):
    settings['density'] = density


def _band(density: float, gamma: float) -> dict:
  """Breadcrumbs' top and bottom of mergekit's density d and gamma γ: drop the top γ and the
  bottom 1 − d − γ; where d + γ > 1, fewer of the top; d = 1 keeps everything."""
  if density >= 1:
    return {'top': 0.0, 'bottom': 0.0}
  bottom = 1.0 - density - gamma
  return {'top': gamma, 'bottom': bottom} if bottom >= 0 else {'top': 1 - density, 'bottom': 0.0}


def _flag(ours: str) -> Callable:
  def translate(settings: dict, value: Any, method: Method, path: str) -> None:
    settings[ours] = _boolean(value, path, ours)
  return translate


def _rescale(settings: dict, value: Any, method: Method, path: str) -> None:
  """rescale: mergekit's L1-norm rescale of the sparsified deltas, where the method has one."""
  wanted = _boolean(value, path, 'parameters.rescale')
  if wanted != ('rescale' in method.settings):
    raise UserError(f'{path}: parameters.rescale = {value} is not supported here for '
                    f'{method.ours} (rescale is {"rescale" in method.settings} for it)')


def _only(default: Any) -> Callable:
  """A parameter supported at mergekit's default alone."""
  def translate(settings: dict, value: Any, method: Method, path: str) -> None:
    if value != default:
      raise UserError(f'{path}: {value!r} is not supported here for this parameter of '
                      f'{method.ours}; only mergekit\'s default {default!r}')
  return translate


def _setting(ours: str, convert: Callable = float) -> Callable:
  def translate(settings: dict, value: Any, method: Method, path: str) -> None:
    settings[ours] = convert(_number(value, path, f'parameters.{ours}'))
  return translate


_TRANSLATE = {
    'density': _density,
    'gamma': lambda *_: None,  # read with density by `_band`
    'epsilon': _setting('epsilon'),
    'normalize': _flag('normalize'),
    'rescale': _rescale,
    'int8_mask': lambda *_: None,  # the dtype of mergekit's masks: here they are booleans
    't': _setting('t'),
    'select_topk': _setting('select_topk'),
    'nuslerp_flatten': _flag('flatten'),
    'nuslerp_row_wise': _flag('row_wise'),
    'normalize_weights': _only(True),
    'filter_wise': _only(False),
    'max_iter': _setting('max_iter', int),
    'tol': _setting('tol'),
}


def _ignored(path: str, key: str, method: str) -> None:
  logging.warning('%s: %s is ignored: mergekit accepts it and does not read it for %s', path,
                  key, method)


def _check_exists(model, path: str, key: str) -> None:
  """A model named in the YAML is a local directory or file (hub names are not fetched)."""
  if not isinstance(model, str) or not os.path.exists(model):
    raise UserError(f'{path}: {key} = {model}: no such directory or file (models are read from '
                    'local paths, never downloaded)')


def _number(value, path: str, key: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise UserError(f'{path}: {key} = {value!r} must be a number')
  return float(value)


def _boolean(value, path: str, key: str) -> bool:
  if not isinstance(value, bool):
    raise UserError(f'{path}: {key} = {value!r} must be true or false')
  return value


def _check_keys(mapping, known, path: str, prefix: str) -> None:
  if not isinstance(mapping, dict):
    raise UserError(f'{path}: {prefix or "the config"} must be a mapping')
  unknown = [k for k in mapping if k not in known]
  if unknown:
    raise UserError(f'{path}: {", ".join(prefix + str(k) for k in unknown)} not supported '
                    f'here; supported at this level: {known}')
