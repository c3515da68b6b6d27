"""mergekit's methods as `merging`'s, and their parameters in `merging`'s settings.

`METHODS` maps each mergekit merge_method onto the method of `merging` it runs, with mergekit's
own defaults for it (generalized_task_arithmetic.py, registry.py and each method's file, as
mergekit 0.1.5 has them); `place` translates one parameter's value into those settings,
value by value where it varies by tensor (`merging.checkpoints.layered`).
"""

import dataclasses
from typing import Any, Callable

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
    model_parameters: the per-model ones (`weight` is config.weights; the others differ
      between models only where the method takes them per vector: config.per_model).
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
    'nearswap': Method('nearswap', {}, ('t',), required=('t',)),
    'arcee_fusion': Method('arcee_fusion', {}),
}
# Every parameter some method reads: one the recipe's method does not is ignored, with a warning.
KNOWN = sorted({p for m in METHODS.values() for p in m.parameters + m.model_parameters})


def place(key: str, spec: Any, method: Method, path: str, settings: dict,
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


def place_per_model(key: str, specs: list, method: Method, path: str, settings: dict,
                     varying: dict, per_model: dict) -> None:
  """Parameter `key`, different between the models, as the setting it translates to given
  per model (its layered values as '<setting>.<i>'); a model that does not give it takes
  mergekit's default."""
  setting = None
  values = []
  for i, spec in enumerate(specs):
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


def _density(settings: dict, density: float, method: Method, path: str) -> None:
  """mergekit's density d (the share kept), in each sparsifier's terms (Breadcrumbs': `_band`)."""
  if not 0 < density <= 1:
    raise UserError(f'{path}: density = {density} must be in (0, 1]')
  if method.ours == 'dare':
    settings['p'] = 1.0 - density
  elif method.ours in ('ties', 'della'):
    settings['density'] = density


def band(density: float, gamma: float) -> dict:
  """Breadcrumbs' top and bottom of mergekit's density d and gamma γ: drop the top γ and the
  bottom 1 − d − γ; where d + γ > 1, fewer of the top; d = 1 keeps everything."""
  if density >= 1:
    return {'top': 0.0, 'bottom': 0.0}
  bottom = 1.0 - density - gamma
  return {'top': gamma, 'bottom': bottom} if bottom >= 0 else {'top': 1 - density, 'bottom': 0.0}


def _flag(ours: str) -> Callable:
  def translate(settings: dict, value: Any, method: Method, path: str) -> None:
    settings[ours] = boolean(value, path, ours)
  return translate


def _rescale(settings: dict, value: Any, method: Method, path: str) -> None:
  """rescale: mergekit's L1-norm rescale of the sparsified deltas, where the method has one."""
  wanted = boolean(value, path, 'parameters.rescale')
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
    settings[ours] = convert(number(value, path, f'parameters.{ours}'))
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



def number(value, path: str, key: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise UserError(f'{path}: {key} = {value!r} must be a number')
  return float(value)


def boolean(value, path: str, key: str) -> bool:
  if not isinstance(value, bool):
    raise UserError(f'{path}: {key} = {value!r} must be true or false')
  return value


