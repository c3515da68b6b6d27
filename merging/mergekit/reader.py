"""mergekit's YAML recipes, read into the fields of a `merging.recipe.Recipe`.

  models:                       # the models (an entry naming the base is the base)
    - model: /models/math
      parameters: {weight: 0.6, density: 0.2}
    - model: /models/code
      parameters: {weight: 0.4, density: 0.2}
  merge_method: ties            # one of methods.METHODS, or passthrough
  base_model: /models/base
  parameters: {normalize: true, lambda: 1.0}   # global; per-model ones may be given here too
  dtype: bfloat16               # of the output (float32, bfloat16, float16)

maps onto the same merges, each with mergekit's own defaults (its generalized task
arithmetic: ties normalizes, dare_ties and dare_linear do not and rescale to each tensor's L1
norm, density 1 keeps everything; `linear` is the normalized weighted task arithmetic
Σ w_t θ_t / Σ w_t = θ0 + Σ w_t τ_t / Σ w_t). mergekit's `--random-seed` is the recipe's seed.

Every parameter may vary by tensor as mergekit's do (`merging.checkpoints.layered`): a
gradient over the layers, `t: [0, 0.5, 1]`, or {filter, value} entries per module; they
become the recipe's layered values. Models may give a parameter different values (per-model)
where the method takes it per vector (TIES' and DELLA's density, DARE's); a model that gives
none takes mergekit's default. `tokenizer_source` (base, union or a model) and the `tokenizer:`
block's `source` (default union) and `pad_to_multiple_of` align every model's embedding rows
to one vocabulary (`merging.checkpoints.vocabulary`); its per-token `tokens:` are refused.
`passthrough` stacks the layer ranges of its `slices`, one source each, with the tokenizer of
the base or a model. A parameter that mergekit knows but ignores for the method (`density` on task_arithmetic) is
accepted with a warning; any other key is named in the error, never ignored. `slices` with
another method merge layer ranges of the models into the output's layers: every slice lists
the same models, the base among them. A model listed twice (by the same real path) is refused,
as mergekit refuses duplicate merge inputs.
"""

import os
from typing import Any

import yaml
from absl import logging

import merging
from editing.errors import UserError
from merging.checkpoints import layered
from merging.checkpoints import sliced
from merging.mergekit import methods
from merging.translation import Translation

_TOP_KEYS = ('models', 'slices', 'merge_method', 'base_model', 'parameters', 'dtype',
             'tokenizer_source', 'tokenizer')
_TOKENIZER_KEYS = ('source', 'pad_to_multiple_of')
_MODEL_KEYS = ('model', 'parameters')


def read(path: str) -> dict[str, Any]:
  """The recipe fields of the mergekit YAML at `path` (`merging.recipe.Recipe`'s names)."""
  doc, text = load_yaml(path, _TOP_KEYS)
  name = doc.get('merge_method')
  if name not in methods.METHODS and name != 'passthrough':
    raise UserError(f'{path}: merge_method {name!r} is not supported here; supported: '
                    f'{sorted(methods.METHODS) + ["passthrough"]}')
  fields = _passthrough(doc, path) if name == 'passthrough' else _merge(doc, path)
  return {**fields, 'dtype': str(doc.get('dtype') or '') or None, 'mergekit_yaml': text}


def _merge(doc: dict, path: str) -> dict[str, Any]:
  """The fields of a recipe that merges with a method."""
  name, slices = doc['merge_method'], None
  if 'slices' in doc:
    doc, slices = _sliced(doc, path)
  tokenizer, pad = _vocabulary(doc, path)
  ours, method = methods.lookup(name)
  given = doc.get('parameters') or {}
  check_keys(given, methods.KNOWN, path, 'parameters.')
  base, models = _models(doc, ours, method, path)
  missing = [key for key in method.required if key not in given]
  if missing:
    raise UserError(f'{path}: {name} requires parameters.{", parameters.".join(missing)}')
  per_model = _per_model(given, models, method, path, name)
  settings, varying, per_model_settings = _settings(given, per_model, ours, method, path)
  if method.base == 'optional':
    settings['task_space'] = bool(doc.get('base_model'))
  check_exists(base, path, 'base_model')
  for i, entry in models:
    check_exists(entry.get('model'), path, f'models[{i}].model' if i >= 0 else 'base_model')
  weights = _weights(per_model.get('weight', []), path, varying)
  if weights is not None and settings.get('normalize') and ours == 'task_arithmetic' \
      and not any(f.startswith('weights.') for f in varying) and sum(weights) == 0:
    raise UserError(f'{path}: parameters.weight of the models sum to 0 ({list(weights)}); '
                    f'{name} divides by their sum')
  scale = 1.0
  if 'lambda' in given and 'lambda' in method.parameters:
    value = _value(given['lambda'], path, 'parameters.lambda')
    if layered.is_scalar(value):
      scale = methods.number(value, path, 'parameters.lambda')
    else:
      varying['scale'] = value
  return dict(base=str(base), models=tuple(str(entry['model']) for _, entry in models),
              method=ours, settings=settings, per_model=per_model_settings,
              layered=varying, slices=slices, weights=weights, scale=scale, tokenizer=tokenizer,
              pad_to_multiple_of=pad)


def _vocabulary(doc: dict, path: str) -> tuple[str | None, int]:
  """(the tokenizer source, pad_to_multiple_of) of `tokenizer_source` or the `tokenizer:`
  block (whose source defaults to union, as mergekit's does); (None, 0) for neither."""
  block = doc.get('tokenizer')
  if block is not None and doc.get('tokenizer_source') is not None:
    raise UserError(f'{path}: give tokenizer_source or tokenizer, not both (mergekit refuses '
                    'both)')
  if block is None:
    source, pad = doc.get('tokenizer_source'), 0
  else:
    check_keys(block, _TOKENIZER_KEYS, path, 'tokenizer.')
    source, pad = block.get('source', 'union'), block.get('pad_to_multiple_of') or 0
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
      raise UserError(f'{path}: tokenizer.pad_to_multiple_of = {pad!r} must be a positive '
                      'integer')
  if source is not None and source not in ('base', 'union'):
    check_exists(source, path, 'tokenizer_source')
    source = str(source)
  return source, pad


def _per_model(given: dict, models: list, method: Translation, path: str,
               name: str) -> dict[str, list]:
  """Each per-model parameter's value for every model: its own, else the global one, else
  None (mergekit's default)."""
  per_model = {key: [] for key in method.model_parameters}
  for i, entry in models:
    own = entry.get('parameters') or {}
    where = f'models[{i}].parameters.'
    check_keys(own, methods.KNOWN, path, where)
    for key in own:
      if key not in method.model_parameters:
        _ignored(path, where + key, name)
    for key in method.model_parameters:
      if key in own:
        per_model[key].append(_value(own[key], path, where + key))
      elif key in given:
        per_model[key].append(_value(given[key], path, 'parameters.' + key))
      else:
        per_model[key].append(None)
  for key in given:
    if key not in method.parameters + method.model_parameters:
      _ignored(path, 'parameters.' + key, name)
  return per_model


def _settings(given: dict, per_model: dict, ours: str, method: Translation,
              path: str) -> tuple[dict, dict, dict]:
  """Our settings, the values that vary by tensor, and the settings given per model."""
  values, differing = {}, {}
  for key, specs in per_model.items():
    if key == 'weight' or all(v is None for v in specs):
      continue
    if all(v == specs[0] for v in specs):
      values[key] = specs[0]
    else:
      differing[key] = specs
  for key in method.parameters:
    if key in given and key != 'lambda':
      values[key] = _value(given[key], path, 'parameters.' + key)
  settings, varying = dict(method.settings), {}
  for key, spec in values.items():
    if method.density_as == 'band' and key in ('density', 'gamma'):
      continue
    methods.place(key, spec, ours, method, path, settings, varying)
  per_model_settings = {}
  for key, specs in differing.items():
    methods.place_per_model(key, specs, ours, method, path, settings, varying, per_model_settings)
  if method.density_as == 'band':
    _band(values.get('density', 1.0), values.get('gamma', 0.01), path, settings, varying)
  return settings, varying, per_model_settings


def _weights(weights: list, path: str, varying: dict) -> tuple[float, ...] | None:
  """Every model's weight (1 standing for one that varies by tensor, given in `varying`), or
  None where no model gives one."""
  if all(w is None for w in weights):
    return None
  if None in weights:
    raise UserError(f'{path}: give every model a weight, or none (parameters.weight for all)')
  varying.update({f'weights.{i}': w for i, w in enumerate(weights) if not layered.is_scalar(w)})
  return tuple(methods.number(w, path, 'parameters.weight') if layered.is_scalar(w) else 1.0
               for w in weights)


def _passthrough(doc: dict, path: str) -> dict[str, Any]:
  """A passthrough recipe: its slices, one source each."""
  slices = []
  for i, piece in enumerate(doc.get('slices') or []):
    check_keys(piece, ('sources',), path, f'slices[{i}].')
    sources = piece.get('sources') or []
    if len(sources) != 1:
      raise UserError(f'{path}: slices[{i}].sources: passthrough takes one source per slice, '
                      f'got {len(sources)}')
    check_keys(sources[0], ('model', 'layer_range'), path, f'slices[{i}].sources[0].')
    span = sources[0].get('layer_range')
    if not sliced.is_layer_range(span):
      raise UserError(f'{path}: slices[{i}].sources[0].layer_range = {span!r}: [first, end)')
    check_exists(sources[0].get('model'), path, f'slices[{i}].sources[0].model')
    slices.append({sources[0]['model']: list(span)})
  if not slices or doc.get('models'):
    raise UserError(f'{path}: passthrough is read here from slices alone')
  given = doc.get('parameters') or {}
  check_keys(given, ('scale',), path, 'parameters.')
  tokenizer = doc.get('tokenizer_source')
  if tokenizer == 'base':
    tokenizer = doc.get('base_model')
  if tokenizer == 'union' or doc.get('tokenizer') is not None:
    raise UserError(f'{path}: passthrough takes one tokenizer, tokenizer_source: base or a '
                    'model; a union or a tokenizer block is built for merges only')
  if tokenizer is not None:
    check_exists(tokenizer, path, 'tokenizer_source')
  scale = _value(given.get('scale', 1.0), path, 'parameters.scale')
  number = layered.is_scalar(scale)
  return dict(base='', models=(), method='passthrough', settings={}, per_model={},
              layered={} if number else {'scale': scale}, slices=tuple(slices), weights=None,
              scale=methods.number(scale, path, 'parameters.scale') if number else 1.0,
              tokenizer=tokenizer)


def _band(density: Any, gamma: Any, path: str, settings: dict, varying: dict) -> None:
  """Breadcrumbs' settings of mergekit's density and gamma, each a number or a gradient over
  the layers (`methods.band`: density and top are theirs, anchor by anchor); anything else is
  named."""
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
  settings.update(top=anchors['gamma'][0], bottom=0.0, density=anchors['density'][0])
  varying.update(top=anchors['gamma'], density=anchors['density'])


def _sliced(doc: dict, path: str) -> tuple[dict, tuple[dict, ...]]:
  """A recipe of slices merged with a method: `doc` with the models its slices list (the
  first slice's order, each with its parameters), and each slice's {model: layer range}."""
  if doc.get('models'):
    raise UserError(f'{path}: give the models in models or in slices, not both')
  slices, models = [], {}
  for k, piece in enumerate(doc.get('slices') or []):
    check_keys(piece, ('sources',), path, f'slices[{k}].')
    ranges = {}
    sources = piece.get('sources') or []
    _check_distinct([s.get('model') if isinstance(s, dict) else None for s in sources], path,
                    f'slices[{k}].sources')
    for i, source in enumerate(sources):
      where = f'slices[{k}].sources[{i}].'
      check_keys(source, ('model', 'layer_range', 'parameters'), path, where)
      model, span = source.get('model'), source.get('layer_range')
      check_exists(model, path, where + 'model')
      if not sliced.is_layer_range(span):
        raise UserError(f'{path}: {where}layer_range = {span!r}: [first, end)')
      parameters = source.get('parameters') or {}
      if models.setdefault(model, parameters) != parameters:
        raise UserError(f'{path}: {where}parameters: {model} is given other parameters in an '
                        'earlier slice; a model takes the same parameters in every slice here')
      ranges[model] = list(span)
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
  return {**{k: v for k, v in doc.items() if k != 'slices'}, 'models': entries}, tuple(slices)


def load_yaml(path: str, top_keys: tuple[str, ...]) -> tuple[dict, str]:
  """(the mapping, its text) of the mergekit YAML at `path`, every top-level key one of
  `top_keys`."""
  try:
    with open(path) as f:
      text = f.read()
  except FileNotFoundError:
    raise UserError(f'no mergekit config at {path}') from None
  try:
    doc = yaml.safe_load(text)
  except yaml.YAMLError as e:
    raise UserError(f'{path} is not valid YAML ({e})') from None
  if not isinstance(doc, dict):
    raise UserError(f'{path}: a mergekit config is a mapping with {top_keys}')
  check_keys(doc, top_keys, path, '')
  return doc, text


def _models(doc: dict, ours: str, method: Translation,
            path: str) -> tuple[str, list[tuple[int, dict]]]:
  """The base checkpoint and the (index, entry) of each model that `ours` merges against it
  (index −1: the base itself, where it is averaged in)."""
  base = doc.get('base_model')
  entries = list(enumerate(doc.get('models') or []))
  for i, entry in entries:
    check_keys(entry, _MODEL_KEYS, path, f'models[{i}].')
  _check_distinct([e.get('model') for _, e in entries], path, 'models')
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
  count = merging.get(ours).vectors
  if count is not None and len(entries) != count:
    raise UserError(f'{path}: {doc["merge_method"]} merges {count} model'
                    f'{"s" if count > 1 else ""} besides the base, got {len(entries)}')
  return base, entries


def _check_distinct(models: list, path: str, key: str) -> None:
  """No model is listed twice, by its path or by another path to the same files (mergekit
  refuses duplicate merge inputs)."""
  seen = {}
  for model in models:
    if not isinstance(model, str):
      continue
    real = os.path.realpath(model)
    if real in seen:
      same = '' if seen[real] == model else f' (as {seen[real]}, the same directory)'
      raise UserError(f'{path}: {key} lists {model} twice{same}; mergekit refuses duplicate '
                      'merge inputs')
    seen[real] = model


def _value(raw: Any, path: str, key: str) -> Any:
  """A parameter's value: a number or flag, or per layer and module (`layered`), checked."""
  layered.check(raw, f'{path}: {key}')
  return raw


def _ignored(path: str, key: str, method: str) -> None:
  logging.warning('%s: %s is ignored: mergekit accepts it and does not read it for %s', path,
                  key, method)


def check_exists(model, path: str, key: str) -> None:
  """A model named in the YAML is a local directory or file (hub names are not fetched)."""
  if not isinstance(model, str) or not os.path.exists(model):
    raise UserError(f'{path}: {key} = {model}: no such directory or file (models are read from '
                    'local paths, never downloaded)')


def check_keys(mapping, known, path: str, prefix: str) -> None:
  if not isinstance(mapping, dict):
    raise UserError(f'{path}: {prefix or "the config"} must be a mapping')
  unknown = [k for k in mapping if k not in known]
  if unknown:
    raise UserError(f'{path}: {", ".join(prefix + str(k) for k in unknown)} not supported '
                    f'here; supported at this level: {known}')
