"""The check every job makes of its config before it writes anything: each range-checked value
(the settings that functions declare themselves, `editing.settings`, are checked there), the
device count and the batch sizes it divides."""

import fnmatch
import numbers
from typing import Any, Callable, Sequence

import jax
import ml_collections

from editing.errors import UserError
from editing.jobs import workdir as workdir_lib


def _integer(low: int) -> tuple[Callable[[Any], bool], str]:
  return (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= low,
          f'an integer ≥ {low}')


def _number(low: float, high: float, *, open_low: bool = False,
            open_high: bool = False) -> tuple[Callable[[Any], bool], str]:
  def test(v):
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
      return False
    return (low < v if open_low else low <= v) and (v < high if open_high else v <= high)

  return test, f'a number in {"(" if open_low else "["}{low:g}, {high:g}{")" if open_high else "]"}'


_INF = float('inf')
# (glob over dotted config keys, (test, what it must be)); the first matching rule applies, and
# a tuple value (a merge grid) is checked value by value.
_RANGES = (
    ('*.warmup_steps', _integer(0)),
    ('*steps', _integer(1)),
    ('*batch_size', _integer(1)),
    ('*_every', _integer(1)),
    ('benchmark.image_size', _integer(0)),
    ('benchmark.eval_batches', _integer(1)),
    ('*_size', _integer(1)),
    ('*.rounds', _integer(1)),
    ('*.accumulation', _integer(1)),
    ('*.seed', _integer(0)),
    ('seed', _integer(0)),
    ('num_devices', _integer(0)),
    ('sharding.fsdp', _integer(1)),
    ('sharding.tensor', _integer(1)),
    ('poison.target', _integer(0)),
    ('eval.disentanglement_points', _integer(1)),
    ('merge.train_examples', _integer(1)),
    ('*learning_rate', _number(0, _INF, open_low=True)),
    ('*logit_scale', _number(0, _INF, open_low=True)),
    ('*.grad_clip', _number(0, _INF, open_low=True)),
    ('*.weight_decay', _number(0, _INF)),
    ('*.val_fraction', _number(0, 1, open_low=True, open_high=True)),
    ('data.epochs.*', _number(0, _INF, open_low=True)),
    ('poison.rate', _number(0, 1)),
    ('talos.keep', _number(0, 1, open_low=True)),
    ('*_step', _number(0, 1, open_low=True)),
    ('eval.negation_threshold', _number(0, 1)),
    ('eval.disentanglement_limit', _number(0, _INF, open_low=True)),
    ('blended.ratio', _number(0, 1)),
    ('benchmark.peak_flops', _number(0, _INF)),
)


def validate(config: ml_collections.ConfigDict, declared: Sequence[str] = ()) -> None:
  """Every range-checked value of the config, the device count and the batch sizes it divides.

  Jobs call this first, so that a bad value is refused before anything is written. The
  sections in `declared` hold settings their functions declare (`editing.settings`), which are
  checked there and skipped here, as is a value left unset (None).
  """
  flat = workdir_lib.dotted(config.to_dict())
  for key, value in flat.items():
    if key.split('.')[0] in declared or value is None:
      continue
    for pattern, (test, expected) in _RANGES:
      if fnmatch.fnmatchcase(key, pattern):
        for v in value if isinstance(value, tuple) else (value,):
          if not test(v):
            raise UserError(f'config.{key} = {v!r}: must be {expected}')
        break
  visible = len(jax.devices())
  if config.get('num_devices', 0) > visible:
    raise UserError(f'config.num_devices = {config.num_devices}, but {visible} devices are '
                    'visible')
  devices = config.get('num_devices', 0) or visible
  layout = config.get('sharding') or {}
  model_parallel = layout.get('fsdp', 1) * layout.get('tensor', 1)
  if devices % model_parallel:
    raise UserError(f'config.sharding: fsdp × tensor = {model_parallel} does not divide the '
                    f'{devices} devices')
  batch_devices = devices // layout.get('tensor', 1)
  for key, value in flat.items():
    if key.endswith('batch_size') and key.split('.')[0] in ('pretrain', 'finetune', 'eval') \
        and value % batch_devices:
      raise UserError(f'config.{key} = {value} is not divisible by the {batch_devices} devices '
                      f'of the data and fsdp axes; use a multiple of {batch_devices}')
