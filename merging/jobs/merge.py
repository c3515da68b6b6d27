"""The merge sweep: every configured method over its hyperparameter grid, chosen on validation.

For every regime of `config.regimes` and method of `config.merge.methods`: merge with every
combination of the method's grid, choose the combination and λ (for the methods that scale
their merge) by mean normalized validation accuracy, report test accuracy there, and save the
merged params with orbax to <workdir>/merge/<regime>/<method>/params. Writes
<workdir>/merge/<regime>/results.json and report.md (methods sorted by mean normalized test
accuracy). A method whose result exists for the same settings is not rerun; under other
settings it is redone and overwritten. Results are kept per method: the report lists every
method whose stored result was made under the current settings, the ones listed in
`config.merge.methods` now and the ones merged before.

Grids are typed config: in a method's section (config.<method>, or the section it shares),
a tuple is one axis of the grid (`config.ties.density = (0.1, 0.2)`, on the command line
`--config.ties.density='(0.1,0.2)'`) and any other value a fixed setting. Every key must be a
keyword setting of the method's function, and every value of the kind of its default.
"""

import dataclasses
import inspect
import itertools
import json
import os
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from editing import checkpoint
from editing import evaluate
from editing import tree as tree_lib
from editing.errors import UserError
from editing.jobs import experiment
from editing.jobs import workdir as workdir_lib
from editing.models import head as head_lib
import merging
from merging import common
from merging.jobs import report


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Merges and evaluates every method of `config.merge.methods` for every regime."""
  experiment.validate(config)
  names = experiment.tasks(config)
  methods = methods_from(config.merge.methods, key='config.merge.methods')
  regimes = experiment.configured_regimes(config)
  for regime in regimes:
    refused = [m for m in methods if regime.name in merging.get(m).refused_regimes]
    if refused:
      raise UserError(f'config.merge.methods: {refused} cannot merge {regime.name} task '
                       'vectors; leave them out for that regime')
  needing_trigger = [m for m in methods if 'trigger' in merging.get(m).reads]
  if needing_trigger:
    raise UserError(f'config.merge.methods: {needing_trigger} read the true backdoor trigger, '
                     'which only the safety experiment (launch.safety) has')
  for m in methods:
    hyperparameter_grid(config, m)
  theta0, apply_fn = experiment.load_pretrained(workdir, config.model.dtype)
  vectors = {r.name: experiment.load_task_vectors(workdir, r.name, names, theta0)
             for r in regimes}
  workdir_lib.use_compilation_cache(workdir)
  data = {t: experiment.load_task(config, t) for t in names}
  heads = {t: experiment.head(config, workdir, data[t], theta0, apply_fn) for t in names}
  return {regime: merge_regime(config, workdir, regime, methods, theta0, apply_fn,
                               regime_vectors, data, heads)
          for regime, regime_vectors in vectors.items()}


def methods_from(value: str, *, key: str) -> list[str]:
  """The comma-separated merging methods of the config value at `key`, each registered."""
  return experiment.names_from(value, key=key, kind='method', known=list(merging.REGISTRY))


def hyperparameter_grid(config: ml_collections.ConfigDict, name: str) -> list[dict]:
  """Every combination of the settings in method `name`'s config section (one empty setting
  when it has no section); tuples are the grid's axes."""
  method = merging.get(name)
  key = method.section or name
  section = config.get(key)
  if section is None:
    return [{}]
  known = method.settings()
  axes = {}
  for setting, value in section.items():
    where = f'config.{key}.{setting}'
    if setting not in known:
      raise UserError(f'{where} is not a setting of {name}; its settings: {sorted(known)}')
    values = tuple(value) if isinstance(value, tuple) else (value,)
    if not values:
      raise UserError(f'{where} is an empty grid; give at least one value')
    default = known[setting].default
    for v in values:
      if not _of_kind(v, default):
        raise UserError(f'{where}: {v!r} is a {type(v).__name__}, but {name} takes a '
                         f'{type(default).__name__} (default {default!r})')
    axes[setting] = values
  return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def swept(config: ml_collections.ConfigDict, name: str) -> list[str]:
  """The settings of method `name` that its config section gives as a grid (tuples)."""
  method = merging.get(name)
  section = config.get(method.section or name)
  return [k for k, v in (section or {}).items() if isinstance(v, tuple)]


def _of_kind(value, default) -> bool:
  """Whether `value` may stand where the signature has `default` (an int may be a float)."""
  if default is inspect.Parameter.empty or default is None:
    return True
  if isinstance(default, bool) or isinstance(value, bool):
    return isinstance(value, bool) and isinstance(default, bool)
  if isinstance(default, float):
    return isinstance(value, (int, float))
  return isinstance(value, type(default))


def merge_regime(config, workdir, regime, methods, theta0, apply_fn, vectors, data,
                 heads) -> dict:
  """The sweep of every method over one regime's task vectors; writes merge/<regime>/."""
  names = list(data)
  evaluator = experiment.evaluator(config, apply_fn, regime)
  finetuned = evaluate.finetuned_accuracy(evaluator, theta0, vectors, heads, data)
  pretrained = {t: evaluator.accuracy(theta0, theta0, heads[t], data[t].test) for t in names}
  inputs = MergeInputs(config, experiment.regime(config, regime).encoder(apply_fn), theta0,
                       apply_fn, heads, data)
  results = {}
  for name in methods:
    directory = os.path.join(workdir_lib.merge_dir(workdir, regime), name)
    result_file = os.path.join(directory, 'result.json')
    if workdir_lib.reusable_result(directory, settings_used(config, name), result_file):
      with open(result_file) as f:
        results[name] = json.load(f)
      logging.info('%s/%s: result found in %s', regime, name, result_file)
      continue
    start = time.time()
    chosen = best_merge(config, name, vectors, inputs, evaluator, finetuned)
    _save_params(os.path.join(directory, 'params'), chosen.params)
    results[name] = {'method': name, **chosen.summary, 'seconds': time.time() - start}
    checkpoint.atomic_write_json(result_file, results[name])
  results.update(_earlier_results(config, workdir_lib.merge_dir(workdir, regime), results))
  summary = {'regime': regime, 'tasks': names, 'pretrained': pretrained,
             'finetuned': finetuned, 'methods': results}
  out = workdir_lib.merge_dir(workdir, regime)
  checkpoint.atomic_write_json(os.path.join(out, 'results.json'), summary)
  checkpoint.atomic_write_bytes(os.path.join(out, 'report.md'),
                                report.merging_markdown(summary).encode())
  print(report.merging_table(summary))
  return summary


def _earlier_results(config, directory: str, done: dict) -> dict:
  """{method: result} of the methods not in `done` merged earlier in `directory` under the
  settings the config now gives them."""
  earlier = {}
  for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
    result_file = os.path.join(directory, name, 'result.json')
    if name in done or name not in merging.REGISTRY or not os.path.exists(result_file):
      continue
    if workdir_lib.recorded_as(os.path.join(directory, name), settings_used(config, name)):
      with open(result_file) as f:
        earlier[name] = json.load(f)
  return earlier


def settings_used(config: ml_collections.ConfigDict, name: str) -> dict:
  """The config a merge's result depends on: its method section and the shared ones (not
  which other methods run beside it)."""
  section = config.get(merging.get(name).section or name)
  shared = {k: v for k, v in config.merge.to_dict().items() if k != 'methods'}
  return {'method': section.to_dict() if section is not None else {}, 'merge': shared,
          'eval': config.eval.to_dict(), **experiment.data_settings(config, 'train_size')}


@dataclasses.dataclass(frozen=True)
class MergeInputs:
  """What a method may read besides the task vectors (`merging.INPUTS`), built on demand."""

  config: ml_collections.ConfigDict
  encoder: Any
  theta0: Any
  apply_fn: Any
  heads: dict
  data: dict  # task name -> suite.Task
  extra: dict = dataclasses.field(default_factory=dict)  # e.g. the oracle's trigger

  def task_data(self, split: str) -> dict[str, common.TaskData]:
    """Each task's logits_fn (the regime's encoder, its frozen head) and inputs: the first
    config.merge.train_examples labeled training examples, or every unlabeled test input."""
    out = {}
    for t, task in self.data.items():
      logits_fn = head_lib.logits_fn(self.encoder, self.theta0, self.heads[t],
                                     self.config.head.logit_scale)
      if split == 'train':
        n = min(self.config.merge.train_examples, len(task.train))
        images, labels = task.train.batch(np.arange(n))
        out[t] = common.TaskData(logits_fn, images, labels)
      else:
        images, _ = task.test.batch(np.arange(len(task.test)))
        out[t] = common.TaskData(logits_fn, images)
    return out

  def read_by(self, name: str) -> dict:
    """The keyword inputs method `name` reads."""
    method = merging.get(name)
    available = {'key': jax.random.PRNGKey(self.config.merge.seed), 'theta0': self.theta0,
                 'apply_fn': self.apply_fn, **self.extra}
    missing = [r for r in method.reads if r != 'data' and r not in available]
    if missing:
      raise UserError(f'{name} reads {missing}, which this experiment does not provide')
    reads = {k: available[k] for k in method.reads if k != 'data'}
    if 'data' in method.reads:
      reads['data'] = self.task_data(method.split)
    return reads


class Chosen(NamedTuple):
  vector: Any  # the merged TaskVector
  params: Any  # θ0 + λ·τ_m at the chosen λ
  summary: dict  # hyperparameters, λ, validation score, test accuracies


def best_merge(config: ml_collections.ConfigDict, name: str, vectors, inputs: MergeInputs,
               evaluator: evaluate.Evaluator, finetuned: dict) -> Chosen:
  """Merges with every setting of the method's grid and keeps the one (and the λ) with the best
  mean normalized validation accuracy; test accuracy reported there."""
  method = merging.get(name)
  reads = inputs.read_by(name)
  names = list(inputs.data)
  best = None
  for settings in hyperparameter_grid(config, name):
    logging.info('%s: merging with %s', name, settings or 'defaults')
    vector = method.merge(vectors, **reads, **settings)
    # A NaN would survive even λ = 0 (0·NaN): refuse it before it is applied or saved.
    tree_lib.check_finite(vector.delta, f'the {name} merge with {settings or "defaults"}')
    addition = evaluate.task_addition(
        evaluator, inputs.theta0, vector, heads=inputs.heads,
        val={t: inputs.data[t].val for t in names}, test={t: inputs.data[t].test for t in names},
        finetuned=finetuned,
        alphas=evaluate.alpha_grid(config.merge.lambda_step) if method.scaled else [1.0])
    score = max(p['normalized_val'] for p in addition['curve'])
    if best is None or score > best[0]:
      best = (score, settings, addition, vector)
  score, settings, addition, vector = best
  logging.info('%s: mean test %.3f (normalized %.3f) with %s at lambda %s', name,
               addition['mean_test'], addition['mean_normalized_test'], settings,
               addition['alpha'])
  summary = {'hyperparameters': settings, 'swept': swept(config, name),
             'lambda': addition['alpha'], 'normalized_val': score,
             **{k: addition[k] for k in ('test', 'normalized_test', 'mean_test',
                                         'mean_normalized_test')}}
  return Chosen(vector, vector.apply_to(inputs.theta0, addition['alpha']), summary)


def _save_params(path: str, params) -> None:
  """The merged params as an orbax checkpoint (written to a temporary name, then renamed)."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(path), params, force=True)
