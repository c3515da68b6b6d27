r"""Merges the task vectors saved by fine-tuning with each configured method and evaluates them.

  python -m launch.merge --config=configs/merge.py [--workdir=workdir/quickstart]

For every regime of `config.regimes` and method of `config.merge.methods`: merge (over the
method's hyperparameter grid), choose the hyperparameters and λ on validation by mean normalized
accuracy, report test accuracy there, and save the merged params with orbax to
<workdir>/merge/<regime>/<method>/params. Writes <workdir>/merge/<regime>/results.json and
report.md (methods sorted by mean normalized test accuracy). A method whose result exists for the
same settings is not rerun; under other settings it is redone and overwritten.
"""

import dataclasses
import itertools
import json
import os
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import app, logging

import merging
from editing import checkpoint
from editing import evaluate
from editing.models import head as head_lib
from launch import common
from launch import report
from merging import base


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  names = common.tasks(config)
  methods = _methods(config)
  regimes = common.configured_regimes(config)
  for regime in regimes:
    refused = [m for m in methods if regime.name in merging.get(m).refused_regimes]
    if refused:
      raise ValueError(f'config.merge.methods: {refused} cannot merge {regime.name} task '
                       'vectors; leave them out for that regime')
  common.use_compilation_cache(workdir)
  theta0, apply_fn = common.load_pretrained(workdir)
  data = {t: common.load_task(config, t) for t in names}
  heads = {t: common.head(config, workdir, data[t], theta0, apply_fn) for t in names}
  results = {}
  for regime in regimes:
    results[regime.name] = merge_regime(config, workdir, regime.name, methods, theta0, apply_fn,
                                        data, heads)
  return results


def _methods(config) -> list[str]:
  return common.names_from(config.merge.methods, key='config.merge.methods', kind='method',
                           known=merging.REGISTRY)


def hyperparameter_grid(section: ml_collections.ConfigDict | None) -> list[dict]:
  """Every combination of a method's settings; a comma-separated string is a grid."""
  if section is None:
    return [{}]
  axes = {k: [_parse(v) for v in value.split(',')] if isinstance(value, str) else [value]
          for k, value in section.items()}
  return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def _parse(text: str):
  text = text.strip()
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def merge_regime(config, workdir, regime, methods, theta0, apply_fn, data, heads) -> dict:
  names = list(data)
  vectors = []
  for t in names:
    path = common.task_vector_file(workdir, regime, t)
    if not os.path.exists(path):
      raise FileNotFoundError(f'no {regime} task vector for {t} at {path}; run launch.finetune '
                              '(or launch.quickstart) with this --workdir and regime first')
    vectors.append(checkpoint.load_task_vector(path)[0])
  evaluator = common.evaluator(config, apply_fn, regime)
  finetuned = finetuned_accuracy(evaluator, theta0, vectors, heads, data)
  pretrained = {t: evaluator.accuracy(theta0, theta0, heads[t], data[t].test) for t in names}
  inputs = MergeInputs(config, common.regime(config, regime).encoder(apply_fn), theta0,
                       apply_fn, heads, data)
  results = {}
  for name in methods:
    directory = os.path.join(common.merge_dir(workdir, regime), name)
    result_file = os.path.join(directory, 'result.json')
    method = merging.get(name)
    if common.reusable_result(directory, settings_used(config, name, method), result_file):
      with open(result_file) as f:
        results[name] = json.load(f)
      logging.info('%s/%s: result found in %s', regime, name, result_file)
      continue
    start = time.time()
    chosen = best_merge(config, name, method, vectors, inputs, evaluator, finetuned)
    _save_params(os.path.join(directory, 'params'), chosen.params)
    results[name] = {'method': name, **chosen.summary, 'seconds': time.time() - start}
    checkpoint.atomic_write_json(result_file, results[name])
  summary = {'regime': regime, 'tasks': names, 'pretrained': pretrained,
             'finetuned': finetuned, 'methods': results}
  out = common.merge_dir(workdir, regime)
  checkpoint.atomic_write_json(os.path.join(out, 'results.json'), summary)
  checkpoint.atomic_write_bytes(os.path.join(out, 'report.md'),
                                report.merging_markdown(summary).encode())
  print(report.merging_table(summary))
  return summary


def finetuned_accuracy(evaluator, theta0, vectors, heads, data) -> dict:
  """Per task, {'val', 'test'} accuracy of its own vector: normalized accuracy's denominators."""
  return {v.tasks[0]: {split: evaluator.accuracy(theta0, evaluator.edit(theta0, v, 1.0),
                                                 heads[v.tasks[0]],
                                                 getattr(data[v.tasks[0]], split))
                       for split in ('val', 'test')} for v in vectors}


def settings_used(config, name: str, method: merging.Method) -> dict:
  """The config a merge's result depends on: its method section and the shared ones."""
  section = config.get(method.section or name)
  return {'method': section.to_dict() if section is not None else {},
          'merge': config.merge.to_dict(), 'eval': config.eval.to_dict(),
          'suite': common.suite_settings(config, 'train_size')}


@dataclasses.dataclass(frozen=True)
class MergeInputs:
  """What a method may read besides the task vectors (merging.INPUTS), built on demand."""

  config: ml_collections.ConfigDict
  encoder: Any
  theta0: Any
  apply_fn: Any
  heads: dict
  data: dict  # task name -> suite.Task
  extra: dict = dataclasses.field(default_factory=dict)  # e.g. the oracle's trigger

  def task_data(self, split: str) -> dict[str, base.TaskData]:
    """Each task's logits_fn (the regime's encoder, its frozen head) and inputs: the first
    config.merge.train_examples labeled training examples, or every unlabeled test input."""
    out = {}
    for t, task in self.data.items():
      logits_fn = lambda params, images, head=self.heads[t]: head_lib.logits(
          self.encoder(self.theta0, params, images), head, self.config.head.logit_scale)
      if split == 'train':
        n = min(self.config.merge.train_examples, len(task.train))
        images, labels = task.train.batch(np.arange(n))
        out[t] = base.TaskData(logits_fn, images, labels)
      else:
        images, _ = task.test.batch(np.arange(len(task.test)))
        out[t] = base.TaskData(logits_fn, images)
    return out

  def read_by(self, method: merging.Method) -> dict:
    available = {'key': jax.random.PRNGKey(self.config.merge.seed), 'theta0': self.theta0,
                 'apply_fn': self.apply_fn, **self.extra}
    reads = {k: available[k] for k in method.reads if k != 'data'}
    if 'data' in method.reads:
      reads['data'] = self.task_data(method.split)
    return reads


class Chosen(NamedTuple):
  vector: Any  # the merged TaskVector
  params: Any  # θ0 + λ·τ_m at the chosen λ
  summary: dict  # hyperparameters, λ, validation score, test accuracies


def best_merge(config, name: str, method: merging.Method, vectors, inputs: MergeInputs,
               evaluator: evaluate.Evaluator, finetuned: dict) -> Chosen:
  """Merges with every setting of the method's grid and keeps the one (and the λ) with the best
  mean normalized validation accuracy; test accuracy reported there."""
  reads = inputs.read_by(method)
  names = list(inputs.data)
  best = None
  for settings in hyperparameter_grid(config.get(method.section or name)):
    logging.info('%s: merging with %s', name, settings or 'defaults')
    vector = method.merge(vectors, **reads, **settings)
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
  summary = {'hyperparameters': settings, 'lambda': addition['alpha'], 'normalized_val': score,
             **{k: addition[k] for k in ('test', 'normalized_test', 'mean_test',
                                         'mean_normalized_test')}}
  return Chosen(vector, vector.apply_to(inputs.theta0, addition['alpha']), summary)


def _save_params(path: str, params) -> None:
  """The merged params as an orbax checkpoint (written to a temporary name, then renamed)."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(path), params, force=True)


if __name__ == '__main__':
  app.run(common.app_main(run))
