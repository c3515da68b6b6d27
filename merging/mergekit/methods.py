"""mergekit's methods as `merging`'s, and their parameters in `merging`'s settings.

`TRANSLATIONS` is plain data keyed by the method of `merging` that runs each mergekit
merge_method: {our method: {mergekit name: Translation}}, with mergekit's own defaults for it
(generalized_task_arithmetic.py, registry.py and each method's file, as mergekit 0.1.5 has
them). Each inner mapping is what a registry entry of `merging` would hold as one field
(`Method.mergekit`). `METHODS` is the same table by mergekit's name. `place` translates one
parameter's value into our settings, value by value where it varies by tensor
(`merging.checkpoints.layered`).
"""

import dataclasses
from typing import Any, Callable

import merging
from editing.errors import UserError
from merging.checkpoints import layered


@dataclasses.dataclass(frozen=True)
class Translation:
  """How one mergekit method maps onto a method of `merging`.

  Attributes:
    ours: the method of `merging` it runs.
    settings: its settings at mergekit's defaults for this method.
    parameters: the global parameters mergekit reads for it (`lambda` is the recipe's scale).
    model_parameters: the per-model ones (`weight` is the recipe's weights; the others differ
      between models only where the method takes them per vector).
    base: 'required' (task vectors against base_model), 'optional' (the task vectors given a
      base_model, else the models' weights: task_space), 'averaged' (the base is one of the
      models averaged, as mergekit's Karcher mean takes every model it is given), or 'none'
      (the models listed are merged, base_model unread: `linear`).
    required: the parameters mergekit requires.
    density_as: where mergekit's density d goes: 'density' (our density, the share kept), 'p'
      (DARE's drop probability 1 − d), 'band' (Breadcrumbs' top and bottom, of d and gamma
      together) or None (the method has none).
  """

  ours: str
  settings: dict
  parameters: tuple[str, ...] = ()
  model_parameters: tuple[str, ...] = ()
  base: str = 'required'
  required: tuple[str, ...] = ()
  density_as: str | None = None


def _gta(ours: str, sparsifier: tuple[str, ...], density_as: str,
         **settings) -> Translation:
  """A sparsifying method of mergekit's generalized task arithmetic (normalize, rescale and
  lambda global; weight, density and the sparsifier's own per model)."""
  return Translation(ours, settings, ('normalize', 'rescale', 'lambda', 'int8_mask'),
                     ('weight', 'density') + sparsifier, density_as=density_as)


_L1 = {'rescale': 'l1_norm'}
_CRUMBS = dict(normalize=False, top=0.0, bottom=0.0)
TRANSLATIONS = {
    'task_arithmetic': {
        'linear': Translation('task_arithmetic', {'normalize': True}, ('normalize',),
                              ('weight',), base='none'),
        'task_arithmetic': Translation('task_arithmetic', {'normalize': False},
                                       ('normalize', 'lambda'), ('weight',))},
    'ties': {'ties': _gta('ties', (), 'density', normalize=True, scope='tensor', density=1.0)},
    'dare': {
        'dare_ties': _gta('dare', (), 'p', then='ties', density=1.0, scope='tensor',
                          normalize=False, p=0.0, **_L1),
        'dare_linear': _gta('dare', (), 'p', then='task_arithmetic', normalize=False, p=0.0,
                            scope='tensor', **_L1)},
    'breadcrumbs': {
        'breadcrumbs': _gta('breadcrumbs', ('gamma',), 'band', elect_sign=False, **_CRUMBS),
        'breadcrumbs_ties': _gta('breadcrumbs', ('gamma',), 'band', elect_sign=True,
                                 **_CRUMBS)},
    'della': {
        'della': _gta('della', ('epsilon',), 'density', elect_sign=True, normalize=True,
                      density=1.0, epsilon=0.15, **_L1),
        'della_linear': _gta('della', ('epsilon',), 'density', elect_sign=False,
                             normalize=False, density=1.0, epsilon=0.15, **_L1)},
    'sce': {'sce': Translation('sce', {'select_topk': 1.0}, ('select_topk', 'int8_mask'))},
    'model_stock': {'model_stock': Translation('model_stock', {'clip': False},
                                               ('filter_wise',))},
    'slerp': {'slerp': Translation('slerp', {}, ('t',), required=('t',))},
    'nuslerp': {'nuslerp': Translation('nuslerp', {'flatten': True, 'row_wise': False},
                                       ('nuslerp_flatten', 'nuslerp_row_wise'), ('weight',),
                                       base='optional')},
    'multislerp': {'multislerp': Translation('multislerp', {}, ('normalize_weights',),
                                             ('weight',), base='optional')},
    'karcher': {'karcher': Translation('karcher', {'max_iter': 10, 'tol': 1e-5,
                                                   'task_space': False},
                                       ('max_iter', 'tol'), base='averaged')},
    'nearswap': {'nearswap': Translation('nearswap', {}, ('t',), required=('t',))},
    'arcee_fusion': {'arcee_fusion': Translation('arcee_fusion', {})},
}
METHODS = {name: t for by_name in TRANSLATIONS.values() for name, t in by_name.items()}
# Every parameter some method reads: one the recipe's method does not is ignored, with a warning.
KNOWN = sorted({p for m in METHODS.values() for p in m.parameters + m.model_parameters})


def place(key: str, spec: Any, method: Translation, path: str, settings: dict,
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


def place_per_model(key: str, specs: list, method: Translation, path: str, settings: dict,
                    varying: dict, per_model: dict) -> None:
  """Parameter `key`, different between the models, as the setting it translates to given
  per model (its layered values as '<setting>.<i>'); a model that does not give it takes
  mergekit's default."""
  setting = None
  values = []
  for spec in specs:
    placed, layered_value = {}, {}
    if spec is not None:
      place(key, spec, method, path, placed, layered_value)
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


def _density(settings: dict, density: float, method: Translation, path: str) -> None:
  """mergekit's density d (the share kept), in the setting the method takes it as (a band's
  is placed with gamma by the reader)."""
  if not 0 < density <= 1:
    raise UserError(f'{path}: density = {density} must be in (0, 1]')
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


def _flag(ours: str) -> Callable:
  def translate(settings: dict, value: Any, method: Translation, path: str) -> None:
    settings[ours] = boolean(value, path, ours)
  return translate


def _rescale(settings: dict, value: Any, method: Translation, path: str) -> None:
  """rescale: mergekit's L1-norm rescale of the sparsified deltas, where the method has one."""
  wanted = boolean(value, path, 'parameters.rescale')
  if wanted != ('rescale' in method.settings):
    raise UserError(f'{path}: parameters.rescale = {value} is not supported here for '
                    f'{method.ours} (rescale is {"rescale" in method.settings} for it)')


def _only(default: Any) -> Callable:
  """A parameter supported at mergekit's default alone."""
  def translate(settings: dict, value: Any, method: Translation, path: str) -> None:
    if value != default:
      raise UserError(f'{path}: {value!r} is not supported here for this parameter of '
                      f'{method.ours}; only mergekit\'s default {default!r}')
  return translate


def _setting(ours: str, convert: Callable = float) -> Callable:
  def translate(settings: dict, value: Any, method: Translation, path: str) -> None:
    settings[ours] = convert(number(value, path, f'parameters.{ours}'))
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
