"""mergekit's YAML configs, the subset people keep, read onto `configs/merge_checkpoints.py`.

  models:                       # the fine-tuned models (an entry naming the base is skipped)
    - model: /models/math
      parameters: {weight: 0.6, density: 0.2}
    - model: /models/code
      parameters: {weight: 0.4, density: 0.2}
  merge_method: ties            # linear, task_arithmetic, ties, dare_linear, dare_ties
  base_model: /models/base
  parameters: {normalize: true, lambda: 1.0}   # global; `weight` and `density` too
  dtype: bfloat16               # of the output (float32, bfloat16, float16)

maps onto the same merges (mergekit's conventions: `linear` is the normalized weighted task
arithmetic Σ w_t θ_t / Σ w_t = θ0 + Σ w_t τ_t / Σ w_t; DARE's `density` is its keep
probability 1 − p, and `dare_ties` elects signs without a magnitude trim). Any other key —
slices, tokenizer_source, a per-model density that differs between models — is named in the
error, never ignored.
"""

import os

import ml_collections
import yaml

from editing.errors import UserError

# mergekit's method -> (ours, its settings); `density` is placed per method below.
METHODS = {
    'linear': ('task_arithmetic', {'normalize': True}),
    'task_arithmetic': ('task_arithmetic', {}),
    'ties': ('ties', {'scope': 'tensor'}),
    'dare_linear': ('dare', {'then': 'task_arithmetic', 'scope': 'tensor'}),
    'dare_ties': ('dare', {'then': 'ties', 'density': 1.0, 'scope': 'tensor'}),
}
_TOP_KEYS = ('models', 'merge_method', 'base_model', 'parameters', 'dtype')
_MODEL_KEYS = ('model', 'parameters')
_PARAMETERS = ('weight', 'density', 'normalize', 'lambda')


def apply(config: ml_collections.ConfigDict, path: str) -> ml_collections.ConfigDict:
  """`config` with the merge of the mergekit YAML at `path` filled in."""
  try:
    with open(path) as f:
      doc = yaml.safe_load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f'no mergekit config at {path}') from None
  except yaml.YAMLError as e:
    raise UserError(f'{path} is not valid YAML ({e})') from None
  if not isinstance(doc, dict):
    raise UserError(f'{path}: a mergekit config is a mapping with {_TOP_KEYS}')
  _check_keys(doc, _TOP_KEYS, path, '')
  method = doc.get('merge_method')
  if method not in METHODS:
    raise UserError(f'{path}: merge_method {method!r} is not supported here; supported: '
                    f'{sorted(METHODS)}')
  base = doc.get('base_model')
  if not base:
    raise UserError(f'{path}: base_model is required (every method here merges task vectors '
                    'against it)')
  defaults = doc.get('parameters') or {}
  _check_keys(defaults, _PARAMETERS, path, 'parameters.')
  models, weights, densities = [], [], set()
  for i, entry in enumerate(doc.get('models') or []):
    _check_keys(entry, _MODEL_KEYS, path, f'models[{i}].')
    if entry.get('model') == base:
      continue
    own = entry.get('parameters') or {}
    where = f'models[{i}].parameters.'
    _check_keys(own, ('weight', 'density'), path, where)
    parameters = {**defaults, **own}
    named = lambda key: (where if key in own else 'parameters.') + key  # where a value is set
    models.append((i, entry.get('model')))
    weights.append(_number(parameters.get('weight', 1.0), path, named('weight')))
    if 'density' in parameters:
      densities.add(_number(parameters['density'], path, named('density')))
  if not models:
    raise UserError(f'{path}: models lists no model other than the base')
  if len(densities) > 1:
    raise UserError(f'{path}: models have different densities {sorted(densities)}; one '
                    'density for all models is supported here')
  _check_exists(base, path, 'base_model')
  for i, model in models:
    _check_exists(model, path, f'models[{i}].model')
  models = [str(model) for _, model in models]

  out = ml_collections.ConfigDict(config.to_dict())
  ours, settings = METHODS[method]
  settings = dict(settings)
  if densities:
    density = densities.pop()
    if ours == 'dare':
      settings['p'] = 1.0 - density
    elif ours == 'ties':
      settings['density'] = density
    else:
      raise UserError(f'{path}: {method} takes no density')
  if 'normalize' in defaults:
    settings['normalize'] = bool(defaults['normalize'])
  out.base, out.models, out.method = str(base), ','.join(models), ours
  out.weights = ','.join(repr(w) for w in weights)
  out.scale = _number(defaults.get('lambda', 1.0), path, 'parameters.lambda')
  out.dtype = str(doc.get('dtype') or '')
  section = out[ours].to_dict() if ours in out else {}
  out[ours] = ml_collections.ConfigDict({**section, **settings})
  return out


def _check_exists(model, path: str, key: str) -> None:
  """A model named in the YAML is a local directory or file (hub names are not fetched)."""
  if not isinstance(model, str) or not os.path.exists(model):
    raise UserError(f'{path}: {key} = {model}: no such directory or file (models are read from '
                    'local paths, never downloaded)')


def _number(value, path: str, key: str) -> float:
  """A parameter's one value; mergekit's per-layer lists (gradients) are not merged here."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise UserError(f'{path}: {key} = {value!r} must be a number (per-layer values, mergekit\'s '
                    'gradients, are not supported here)')
  return float(value)


def _check_keys(mapping, known, path: str, prefix: str) -> None:
  if not isinstance(mapping, dict):
    raise UserError(f'{path}: {prefix or "the config"} must be a mapping')
  unknown = [k for k in mapping if k not in known]
  if unknown:
    raise UserError(f'{path}: {", ".join(prefix + str(k) for k in unknown)} not supported '
                    f'here; supported at this level: {known}')
