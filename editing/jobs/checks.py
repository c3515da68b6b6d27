"""The check every job makes of its config before it writes anything: each section it reads
against the declaration of its settings (`editing.settings`, beside the code that reads them),
the device count and the batch sizes it divides.

A job passes the declarations of its own sections (config.finetune: `finetune.TRAINING`, ...);
the sections every job reads through `editing.jobs.experiment` are checked always: the regimes'
and the triggers' own (config.talos, config.badnets, ...: declared on their classes), the
poisoning (`triggers.POISON`), the suite's, the datasets' and the heads' (`suite.SETTINGS`,
`images.SETTINGS`, `head.SETTINGS`), and the device sections declared here.
"""

from typing import Any, Mapping

import jax
import ml_collections

from editing import regimes
from editing import settings
from editing import sweep
from editing.data import images
from editing.data import suite
from editing.data import text_suite
from editing.data import triggers
from editing.errors import UserError
from editing.models import head

# The device mesh, which `editing.jobs.experiment` reads for every job.
SHARDING = dict(
    preset=settings.choice('dp', ('dp', 'fsdp', 'fsdp+tp'), 'the logical-axis rules'),
    fsdp=settings.integer(1, '[1, inf)', 'devices of the fsdp axis'),
    tensor=settings.integer(1, '[1, inf)', 'devices of the tensor axis'))
NUM_DEVICES = settings.integer(0, '[0, inf)', 'the devices used; 0: every visible one')


def validate(config: ml_collections.ConfigDict,
             sections: Mapping[str, Any] | None = None) -> None:
  """Every declared setting of the config, the device count and the batch sizes it divides.

  Jobs call this first, so that a bad value is refused before anything is written. `sections`
  maps the config sections the job reads itself to their declarations; a value left unset
  (None) is not checked, and each value of a sweep's axis over a declared setting
  (config.sweep.<section>.<setting>) is checked as a value is.
  """
  for name, declared in {**_shared(config), **(sections or {})}.items():
    _check_section(config, name, settings.of(declared))
  if config.get('num_devices') is not None:
    NUM_DEVICES.check(config.num_devices, 'config.num_devices')
  _check_devices(config)


def _shared(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The sections every job reads through `editing.jobs.experiment`, and their declarations:
  config.suite is the text suite's for a decoder (a `model_type` in config.model)."""
  declared = {**regimes.REGISTRY, **triggers.REGISTRY}
  return {**{name: owner for name, owner in declared.items()
             if isinstance(owner, settings.Declared)},
          'poison': triggers.POISON,
          'suite': text_suite.SETTINGS if 'model_type' in (config.get('model') or {})
                   else suite.SETTINGS,
          'data': images.SETTINGS,
          'head': head.SETTINGS, 'sharding': SHARDING}


def _check_section(config: ml_collections.ConfigDict, name: str, declared: dict) -> None:
  """config.<name>'s declared settings that are set, and the sweep axes over them."""
  section = config.get(name)
  if section is not None:
    for key, value in section.items():
      if key in declared and value is not None:
        declared[key].check(value, f'config.{name}.{key}')
  for key, axis in sweep.axes(config, name).items():
    setting = key[len(name) + 1:]
    if setting in declared:
      for value in axis:
        declared[setting].check(value, f'config.sweep.{key}')


def _check_devices(config: ml_collections.ConfigDict) -> None:
  """The devices asked for are visible, fsdp × tensor divides them, and the training and
  evaluation batch sizes divide over the data and fsdp axes."""
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
  for name in ('pretrain', 'finetune', 'eval'):
    value = (config.get(name) or {}).get('batch_size')
    if value is not None and value % batch_devices:
      raise UserError(f'config.{name}.batch_size = {value} is not divisible by the '
                      f'{batch_devices} devices of the data and fsdp axes; use a multiple of '
                      f'{batch_devices}')
