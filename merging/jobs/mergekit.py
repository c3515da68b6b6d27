"""mergekit's YAML recipes, read onto `configs/merge_checkpoints.py`.

  models:                       # the models (an entry naming the base is the base)
    - model: /models/math
      parameters: {weight: 0.6, density: 0.2}
    - model: /models/code
      parameters: {weight: 0.4, density: 0.2}
  merge_method: ties            # one of mergekit_methods.METHODS, or passthrough
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
default. `passthrough` stacks the layer ranges of its `slices` (`merging.checkpoints.
passthrough`); `tokenizer_source: base` keeps the base's tokenizer, as the merges do anyway.
A parameter that mergekit knows but ignores for the method (`density` on task_arithmetic) is
accepted with a warning; any other key (a tokenizer union, parameters per slice) is named in
the error, never ignored. `slices` with another method merge layer ranges of the models into
the output's layers (`merging.checkpoints.sliced`): every slice lists the same models, the
base among them, and gradients run over each slice's layers, as mergekit plans them.
"""

import json
import os
from typing import Any

import ml_collections
import yaml
from absl import logging

import merging
from editing.errors import UserError
from merging.checkpoints import layered
from merging.checkpoints import sliced
from merging.jobs import mergekit_methods as methods

_TOP_KEYS = ('models', 'slices', 'merge_method', 'base_model', 'parameters', 'dtype',
             'tokenizer_source')
_MODEL_KEYS = ('model', 'parameters')


def apply(config: ml_collections.ConfigDict, path: str) -> ml_collections.ConfigDict:
  """`config` with the merge of the mergekit YAML at `path` filled in."""
  doc = _read(path)
  _check_keys(doc, _TOP_KEYS, path, '')
  name = doc.get('merge_method')
  if name not in methods.METHODS and name != 'passthrough':
    raise UserError(f'{path}: merge_method {name!r} is not supported here; supported: '
                    f'{sorted(methods.METHODS) + ["passthrough"]}')
  if name == 'passthrough':
    return _passthrough(config, doc, path)
  slices = None
  if 'slices' in doc:
    doc, slices = _sliced(doc, path)
  tokenizer = doc.get('tokenizer_source')
  if tokenizer not in (None, 'base') and tokenizer != doc.get('base_model'):
    raise UserError(f'{path}: tokenizer_source = {tokenizer!r}: the output takes the base '
                    "model's tokenizer here ('base'); a union or another model's is not built")
  method = methods.METHODS[name]
  given = doc.get('parameters') or {}
  _check_keys(given, methods.KNOWN, path, 'parameters.')
  base, models = _models(doc, method, path)
  missing = [key for key in method.required if key not in given]
  if missing:
    raise UserError(f'{path}: {name} requires parameters.{", parameters.".join(missing)}')

  per_model = {key: [] for key in method.model_parameters}
  for i, entry in models:
    own = entry.get('parameters') or {}
    where = f'models[{i}].parameters.'
    _check_keys(own, methods.KNOWN, path, where)
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
    methods.place(key, spec, method, path, settings, varying)
  per_model_settings = {}
  for key, specs in differing.items():
    methods.place_per_model(key, specs, method, path, settings, varying, per_model_settings)
  if method.ours == 'breadcrumbs':
    _breadcrumbs_band(values.get('density', 1.0), values.get('gamma', 0.01), path, settings,
                      varying)
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
      out.scale = methods.number(scale, path, 'parameters.lambda')
    else:
      varying['scale'] = scale
  out.layered = json.dumps(varying) if varying else ''
  out.per_model = json.dumps(per_model_settings) if per_model_settings else ''
  out.dtype = str(doc.get('dtype') or '')
  out.slices = json.dumps(slices) if slices else ''
  section = out[method.ours].to_dict() if method.ours in out else {}
  out[method.ours] = ml_collections.ConfigDict({**section, **settings})
  return out


def _passthrough(config: ml_collections.ConfigDict, doc: dict,
                 path: str) -> ml_collections.ConfigDict:
  """A passthrough recipe: its slices (one source each) onto config.passthrough."""
  slices = []
  for i, piece in enumerate(doc.get('slices') or []):
    _check_keys(piece, ('sources',), path, f'slices[{i}].')
    sources = piece.get('sources') or []
    if len(sources) != 1:
      raise UserError(f'{path}: slices[{i}].sources: passthrough takes one source per slice, '
                      f'got {len(sources)}')
    _check_keys(sources[0], ('model', 'layer_range'), path, f'slices[{i}].sources[0].')
    span = sources[0].get('layer_range')
    if not sliced.is_layer_range(span):
      raise UserError(f'{path}: slices[{i}].sources[0].layer_range = {span!r}: [first, end)')
    _check_exists(sources[0].get('model'), path, f'slices[{i}].sources[0].model')
    slices.append([sources[0]['model'], *span])
  if not slices or doc.get('models'):
    raise UserError(f'{path}: passthrough is read here from slices alone')
  given = doc.get('parameters') or {}
  _check_keys(given, ('scale',), path, 'parameters.')
  tokenizer = doc.get('tokenizer_source')
  if tokenizer == 'base':
    tokenizer = doc.get('base_model')
  if tokenizer is not None:
    _check_exists(tokenizer, path, 'tokenizer_source')
  out = ml_collections.ConfigDict(config.to_dict())
  out.method, out.dtype = 'passthrough', str(doc.get('dtype') or '')
  out.passthrough = ml_collections.ConfigDict({
      'slices': json.dumps(slices), 'tokenizer': tokenizer or '',
      'scale': json.dumps(_value(given.get('scale', 1.0), path, 'parameters.scale'))})
  return out


def _breadcrumbs_band(density: Any, gamma: Any, path: str, settings: dict,
                      varying: dict) -> None:
  """Breadcrumbs' band (top, bottom) of mergekit's density and gamma, each a number or a
  gradient over the layers. Where neither clips (d < 1, d + γ ≤ 1 at every anchor), top = γ
  and bottom = 1 − d − γ are linear in them, so gradients of d and γ are gradients of the
  band, anchor by anchor; anything else is named."""
  specs = {'density': density, 'gamma': gamma}
  for key, spec in specs.items():
    if not (layered.is_scalar(spec) or all(layered.is_scalar(v) for v in spec)):
      raise UserError(f'{path}: breadcrumbs\' {key} is a number or a gradient here (per-module '
                      'filters of it are not supported)')
  lengths = {len(v) for v in specs.values() if not layered.is_scalar(v)}
  if not lengths:
    settings.update(methods.band(methods.number(density, path, 'density'),
                                 methods.number(gamma, path, 'gamma')))
    return
  if len(lengths) > 1:
    raise UserError(f'{path}: breadcrumbs\' density and gamma are gradients of different '
                    'lengths; give them the same anchors')
  count = lengths.pop()
  anchors = {k: [methods.number(x, path, k)
                 for x in (v if isinstance(v, list) else [v] * count)]
             for k, v in specs.items()}
  if any(d >= 1 or d + g > 1 for d, g in zip(anchors['density'], anchors['gamma'])):
    raise UserError(f'{path}: breadcrumbs\' density and gamma vary by layer, and at some '
                    'anchor density is 1 or density + gamma exceeds 1, where the band clips; '
                    'give density + gamma ≤ 1 throughout')
  top = anchors['gamma']
  bottom = [1 - d - g for d, g in zip(anchors['density'], top)]
  settings.update(top=top[0], bottom=bottom[0])
  varying.update(top=top, bottom=bottom)


def _sliced(doc: dict, path: str) -> tuple[dict, list[dict]]:
  """A recipe of slices merged with a method: `doc` with the models its slices list (the
  first slice's order, each with its parameters), and each slice's {model: layer range}."""
  if doc.get('models'):
    raise UserError(f'{path}: give the models in models or in slices, not both')
  slices, models = [], {}
  for k, piece in enumerate(doc.get('slices') or []):
    _check_keys(piece, ('sources',), path, f'slices[{k}].')
    ranges = {}
    for i, source in enumerate(piece.get('sources') or []):
      where = f'slices[{k}].sources[{i}].'
      _check_keys(source, ('model', 'layer_range', 'parameters'), path, where)
      model, span = source.get('model'), source.get('layer_range')
      _check_exists(model, path, where + 'model')
      if not sliced.is_layer_range(span):
        raise UserError(f'{path}: {where}layer_range = {span!r}: [first, end)')
      parameters = source.get('parameters') or {}
      if models.setdefault(model, parameters) != parameters:
        raise UserError(f'{path}: {where}parameters: {model} is given other parameters in an '
                        'earlier slice; a model takes the same parameters in every slice here')
      ranges[model] = span
    if k and set(ranges) != set(slices[0]):
      raise UserError(f'{path}: slices[{k}] merges {sorted(ranges)}, slices[0] '
                      f'{sorted(slices[0])}; every slice merges the same models here')
    slices.append(ranges)
  if not slices:
    raise UserError(f'{path}: slices lists no slice')
  base = doc.get('base_model')
  if base and base not in slices[0]:
    raise UserError(f'{path}: base_model {base} is not a source of the slices; every slice '
                    'gives the base a layer range too')
  entries = [{'model': m, **({'parameters': p} if p else {})} for m, p in models.items()]
  return {**{k: v for k, v in doc.items() if k != 'slices'}, 'models': entries}, slices


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


def _models(doc: dict, method: 'methods.Method',
            path: str) -> tuple[str, list[tuple[int, dict]]]:
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


def _ignored(path: str, key: str, method: str) -> None:
  logging.warning('%s: %s is ignored: mergekit accepts it and does not read it for %s', path,
                  key, method)


def _check_exists(model, path: str, key: str) -> None:
  """A model named in the YAML is a local directory or file (hub names are not fetched)."""
  if not isinstance(model, str) or not os.path.exists(model):
    raise UserError(f'{path}: {key} = {model}: no such directory or file (models are read from '
                    'local paths, never downloaded)')


def _check_keys(mapping, known, path: str, prefix: str) -> None:
  if not isinstance(mapping, dict):
    raise UserError(f'{path}: {prefix or "the config"} must be a mapping')
  unknown = [k for k in mapping if k not in known]
  if unknown:
    raise UserError(f'{path}: {", ".join(prefix + str(k) for k in unknown)} not supported '
                    f'here; supported at this level: {known}')
