"""mergekit's methods as `merging`'s, and their parameters in `merging`'s settings.

Each registry entry of `merging` holds the mergekit merge_methods it runs (`Method.mergekit`,
a `merging.translation.Translation` each): `lookup` scans the registry for a mergekit name's
method and Translation, and `METHODS` lists every name. `place` translates one parameter's
value into our settings, value by value where it varies by tensor
(`merging.checkpoints.layered`).
"""

from typing import Any, Callable

import merging
from editing.errors import UserError
from merging.checkpoints import layered
from merging.translation import Translation


def _translations() -> list[tuple[str, str, Translation]]:
  """(mergekit's name, the method of `merging` that runs it, how) for every one read here."""
  return [(name, ours, translation) for ours, method in merging.REGISTRY.items()
          for name, translation in method.mergekit.items()]


# The merge_methods read here besides passthrough, which the reader takes apart.
METHODS = tuple(name for name, _, _ in _translations())
# Every parameter some method reads: one the recipe's method does not is ignored, with a warning.
KNOWN = sorted({p for _, _, t in _translations() for p in t.parameters + t.model_parameters})


def lookup(name: str) -> tuple[str, Translation]:
  """The method of `merging` that runs mergekit's merge_method `name` (one of METHODS), and
  its Translation."""
  return next((ours, t) for known, ours, t in _translations() if known == name)


def place(key: str, spec: Any, ours: str, method: Translation, path: str, settings: dict,
          varying: dict) -> None:
  """Parameter `key`'s value in `settings`, or, where it varies by tensor, in `varying` as
  the setting it translates to (for our method `ours`), translated value by value."""
  if layered.is_scalar(spec):
    _TRANSLATE[key](settings, spec, ours, method, path)
    return
  translated = {}

  def one(value):
    placed = {}
    _TRANSLATE[key](placed, value, ours, method, path)
    if len(placed) != 1:
      raise UserError(f'{path}: {key} cannot vary by layer or module here')
    (setting, result), = placed.items()
    translated.setdefault('setting', setting)
    return result

  varying_spec = layered.map_values(spec, one)
  varying[translated['setting']] = varying_spec


def place_per_model(key: str, specs: list, ours: str, method: Translation, path: str,
                    settings: dict, varying: dict, per_model: dict) -> None:
  """Parameter `key`, different between the models, as the setting it translates to given
  per model (its layered values as '<setting>.<i>'); a model that does not give it takes
  mergekit's default."""
  setting = None
  values = []
  for spec in specs:
    placed, layered_value = {}, {}
    if spec is not None:
      place(key, spec, ours, method, path, placed, layered_value)
    if len(placed) + len(layered_value) > 1:
      raise UserError(f'{path}: {key} cannot differ between models here')
    (name, value), = (placed or layered_value or {None: None}).items()
    if name is not None:
      setting = setting or name
    values.append((value, bool(layered_value)))
  if setting is None or setting not in merging.get(ours).per_vector:
    raise UserError(f'{path}: the models have different values of {key} ({specs}); '
                    f'{ours} takes one {key} for all models')
  per_model[setting] = [settings[setting] if v is None or is_layered else v
                        for v, is_layered in values]
  for i, (value, is_layered) in enumerate(values):
    if is_layered:
      varying[f'{setting}.{i}'] = value


def _density(settings: dict, density: float, ours: str, method: Translation,
             path: str) -> None:
  """mergekit's density d (the share kept), in the setting the method takes it as (a band's
  is placed with gamma by the reader). d is checked against our own density, also the share
  kept, as the method declares it (each with density_as 'density' or 'p' declares one)."""
  merging.get(ours).settings['density'].check(density, f'{path}: density')
  if method.density_as == 'p':
    settings['p'] = 1.0 - density
  elif method.density_as == 'density':
    settings['density'] = density


def band(density: float, gamma: float) -> dict:
  """Breadcrumbs' settings of mergekit's density d and gamma γ: the ⌊d·n⌋ largest after the
  ⌊γ·n⌋ largest, counted as mergekit counts them; d = 1 keeps everything."""
  if density >= 1:
    return {'top': 0.0, 'bottom': 0.0, 'density': None}
  return {'top': gamma, 'bottom': 0.0, 'density': density}


def _flag(setting: str) -> Callable:
  def translate(settings: dict, value: Any, ours: str, method: Translation, path: str) -> None:
    settings[setting] = boolean(value, path, setting)
  return translate


def _rescale(settings: dict, value: Any, ours: str, method: Translation, path: str) -> None:
  """rescale: mergekit's L1-norm rescale of the sparsified deltas, where the method has one."""
  wanted = boolean(value, path, 'parameters.rescale')
  if wanted != ('rescale' in method.settings):
    raise UserError(f'{path}: parameters.rescale = {value} is not supported here for '
                    f'{ours} (rescale is {"rescale" in method.settings} for it)')


def _only(default: Any) -> Callable:
  """A parameter supported at mergekit's default alone."""
  def translate(settings: dict, value: Any, ours: str, method: Translation, path: str) -> None:
    if value != default:
      raise UserError(f'{path}: {value!r} is not supported here for this parameter of '
                      f'{ours}; only mergekit\'s default {default!r}')
  return translate


def _setting(setting: str, convert: Callable = float) -> Callable:
  def translate(settings: dict, value: Any, ours: str, method: Translation, path: str) -> None:
    settings[setting] = convert(number(value, path, f'parameters.{setting}'))
  return translate


_TRANSLATE = {
    'density': _density,
    'gamma': lambda *_: None,  # read with density into the band
    'epsilon': _setting('epsilon'),
    'normalize': _flag('normalize'),
    'rescale': _rescale,
    'int8_mask': lambda *_: None,  # the dtype of mergekit's masks: here they are booleans
    't': _setting('t'),
    'select_topk': _setting('select_topk'),
    'nuslerp_flatten': _flag('flatten'),
    'nuslerp_row_wise': _flag('row_wise'),
    'normalize_weights': _only(True),
    'filter_wise': _flag('filter_wise'),
    'max_iter': _setting('max_iter', int),
    'tol': _setting('tol'),
}


def number(value, path: str, key: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise UserError(f'{path}: {key} = {value!r} must be a number')
  return float(value)


def boolean(value, path: str, key: str) -> bool:
  if not isinstance(value, bool):
    raise UserError(f'{path}: {key} = {value!r} must be true or false')
  return value
