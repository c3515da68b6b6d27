"""What every job reads from an experiment's config and workdir: the tasks, regimes and triggers
it names, the suite's data, the mesh, the model, the pretrained backbone θ0, the frozen heads and
the evaluator."""

import os
from typing import Any, Sequence

import jax
import ml_collections

from editing import checkpoint
from editing import evaluate
from editing import regimes
from editing import sharding
from editing.data import suite
from editing.data import triggers
from editing.jobs import workdir as workdir_lib
from editing.models import head as head_lib
from editing.models import vit


def names_from(value: str, *, key: str, kind: str, known: Sequence[str]) -> list[str]:
  """The comma-separated names of the config value at `key`, each one of `known`."""
  names = [n.strip() for n in value.split(',') if n.strip()]
  unknown = [n for n in names if n not in known]
  if unknown or not names:
    raise ValueError(f'{key}: unknown {kind}(s) {unknown or names}; choose from '
                     f'{",".join(known)}')
  return names


def tasks(config: ml_collections.ConfigDict) -> list[str]:
  """The downstream tasks named by `config.suite.tasks`, validated."""
  return names_from(config.suite.tasks, key='config.suite.tasks', kind='task',
                    known=suite.DOWNSTREAM_TASKS)


def configured_regimes(config: ml_collections.ConfigDict) -> list[regimes.Regime]:
  """The regimes named by `config.regimes`, each with its settings section (e.g. config.talos)."""
  return [regime(config, r) for r in names_from(config.regimes, key='config.regimes',
                                                kind='regime', known=list(regimes.REGISTRY))]


def regime(config: ml_collections.ConfigDict, name: str) -> regimes.Regime:
  """The regime `name` with the settings of its config section, if it has one."""
  return regimes.get(name, _section(config, name))


def poisoned_tasks(config: ml_collections.ConfigDict) -> list[str]:
  """The tasks `config.poison.tasks` names (none when it is empty)."""
  if not config.poison.tasks.strip():
    return []
  return names_from(config.poison.tasks, key='config.poison.tasks', kind='task',
                    known=suite.DOWNSTREAM_TASKS)


def trigger(config: ml_collections.ConfigDict, name: str) -> triggers.Trigger:
  """The trigger `name` with the settings of its config section (e.g. config.badnets)."""
  return triggers.get(name, _section(config, name))


def _section(config: ml_collections.ConfigDict, name: str) -> dict | None:
  section = config.get(name)
  return section.to_dict() if section is not None else None


def load_task(config: ml_collections.ConfigDict, name: str) -> suite.Task:
  size = config.suite.pretrain_size if name == suite.CONTROL_TASK else config.suite.train_size
  return suite.load_task(name, seed=config.suite.seed, train_size=size,
                         test_size=config.suite.test_size, val_fraction=config.suite.val_fraction)


def suite_settings(config: ml_collections.ConfigDict, *names: str) -> dict:
  """The named `config.suite` fields, for recording what a job's data depended on."""
  return {name: config.suite[name] for name in ('seed', 'val_fraction', 'test_size') + names}


def mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  return sharding.make_mesh(config.num_devices or None)


def model(config_model: ml_collections.ConfigDict | dict):
  """(the encoder module, apply_fn(params, images))."""
  module = vit.build(ml_collections.ConfigDict(dict(config_model)))
  return module, lambda params, images: module.apply({'params': params}, images)


def load_pretrained(workdir: str):
  """(θ0, apply_fn) from <workdir>/pretrain/params.safetensors, built from its own metadata."""
  path = workdir_lib.pretrained_file(workdir)
  if not os.path.exists(path):
    raise FileNotFoundError(f'no pretrained backbone at {path}; run launch.pretrain (or '
                            'launch.quickstart) with this --workdir first')
  params, meta = checkpoint.load_tree(path)
  _, apply_fn = model(meta['model'])
  return params, apply_fn


def evaluator(config: ml_collections.ConfigDict, apply_fn, regime_name: str) -> evaluate.Evaluator:
  return evaluate.Evaluator(regimes.get(regime_name).encoder(apply_fn),
                            logit_scale=config.head.logit_scale, mesh=mesh(config),
                            batch_size=config.eval.batch_size)


def head(config: ml_collections.ConfigDict, workdir: str, task: suite.Task, theta0: Any,
         apply_fn) -> jax.Array:
  """The task's frozen prototype head on θ0, fitted once and cached in the workdir."""
  path = workdir_lib.head_file(workdir, task.name)
  if not os.path.exists(path):
    features = evaluator(config, apply_fn, 'full').features(theta0, theta0, task.train)
    checkpoint.save_tree(path, {'head': head_lib.fit_prototypes(
        features, task.train.labels, task.num_classes)})
  return checkpoint.load_tree(path)[0]['head']
