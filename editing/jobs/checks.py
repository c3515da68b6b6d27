"""The check every job makes of its config before it writes anything: each section it reads
against the declaration of its settings (`editing.settings`, beside the code that reads them),
the device count and the batch sizes it divides.

A job passes the declarations of its own sections (config.finetune: `finetune.TRAINING`, ...);
the sections every job reads through `editing.jobs.experiment` are checked always: the regimes'
and the triggers' own (config.talos, config.badnets, ...: declared on their classes), the
poisoning (`triggers.POISON`), and the data, head and device sections declared here.
"""

from typing import Any, Mapping

import jax
import ml_collections

from editing import regimes
from editing import settings
from editing import sweep
from editing.data import triggers
from editing.errors import UserError

# The sections `editing.jobs.experiment` reads for every job: the built-in suite or the
# datasets on disk, the frozen heads, and the device mesh.
SUITE = dict(
    seed=settings.integer(0, '[0, inf)', 'draws the suite\'s data'),
    tasks=settings.text('', 'the tasks, comma-separated'),
    train_size=settings.integer(5000, '[1, inf)', 'training examples per task'),
    test_size=settings.integer(1000, '[1, inf)', 'test examples per task'),
    val_fraction=settings.number(0.1, '(0, 1)', 'the share of training examples held out'),
    pretrain_size=settings.integer(25000, '[1, inf)', 'examples of the control task\'s corpus'))
DATA = dict(
    seed=settings.integer(0, '[0, inf)', 'draws the validation split held out'),
    val_fraction=settings.number(0.1, '(0, 1)', 'the share of training examples held out, '
                                                'where a dataset has no val split'),
    image_size=settings.integer(224, '[1, inf)', 'the side images are resized to'))
HEAD = dict(logit_scale=settings.number(30.0, '(0, inf)', 'the cosine logits\' scale'))
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
  for name, declared in {**_shared(), **(sections or {})}.items():
    _check_section(config, name, settings.of(declared))
  if config.get('num_devices') is not None:
    NUM_DEVICES.check(config.num_devices, 'config.num_devices')
  _check_devices(config)


def _shared() -> dict[str, Any]:
  """The sections every job reads through `editing.jobs.experiment`, and their declarations."""
  declared = {**regimes.REGISTRY, **triggers.REGISTRY}
  return {**{name: owner for name, owner in declared.items()
             if isinstance(owner, settings.Declared)},
          'poison': triggers.POISON, 'suite': SUITE, 'data': DATA, 'head': HEAD,
          'sharding': SHARDING}


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
