r"""Merges the task vectors saved by fine-tuning with each configured method and evaluates them.

  python -m launch.merge --config=configs/merge.py [--workdir=workdir/quickstart]

For every regime of `config.regimes` and method of `config.merge.methods`: merge (over the
method's hyperparameter grid), choose the hyperparameters and λ on validation by mean normalized
accuracy, report test accuracy there, and save the merged params with orbax to
<workdir>/merge/<regime>/<method>/params. Writes <workdir>/merge/<regime>/results.json and
report.md (methods sorted by mean normalized test accuracy). A method whose result exists for the
same settings is not rerun; under other settings it is redone and overwritten.
"""

import itertools
import json
import os
import time

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
  finetuned = {t: {split: evaluator.accuracy(theta0, evaluator.edit(theta0, v, 1.0), heads[t],
                                             getattr(data[t], split))
                   for split in ('val', 'test')} for t, v in zip(names, vectors)}
  pretrained = {t: evaluator.accuracy(theta0, theta0, heads[t], data[t].test) for t in names}
  encoder = common.regime(config, regime).encoder(apply_fn)

  def task_data(split: str) -> dict[str, base.TaskData]:
    out = {}
    for t in names:
      logits_fn = lambda params, images, head=heads[t]: head_lib.logits(
          encoder(theta0, params, images), head, config.head.logit_scale)
      if split == 'train':
        n = min(config.merge.train_examples, len(data[t].train))
        images, labels = data[t].train.batch(np.arange(n))
        out[t] = base.TaskData(logits_fn, images, labels)
      else:
        images, _ = data[t].test.batch(np.arange(len(data[t].test)))
        out[t] = base.TaskData(logits_fn, images)
    return out

  inputs = {'key': jax.random.PRNGKey(config.merge.seed), 'theta0': theta0,
            'apply_fn': apply_fn}
  lambdas = evaluate.alpha_grid(config.merge.lambda_step)
  results = {}
  for name in methods:
    method = merging.get(name)
    directory = os.path.join(common.merge_dir(workdir, regime), name)
    result_file = os.path.join(directory, 'result.json')
    settings_used = {
        'method': (config.get(name).to_dict() if config.get(name) is not None else {}),
        'merge': config.merge.to_dict(), 'eval': config.eval.to_dict(),
        'suite': common.suite_settings(config, 'train_size')}
    if common.reusable_result(directory, settings_used, result_file):
      with open(result_file) as f:
        results[name] = json.load(f)
      logging.info('%s/%s: result found in %s', regime, name, result_file)
      continue
    start = time.time()
    reads = {k: inputs[k] for k in method.reads if k != 'data'}
    if 'data' in method.reads:
      reads['data'] = task_data(method.split)
    best = None
    for settings in hyperparameter_grid(config.get(name)):
      logging.info('%s/%s: merging with %s', regime, name, settings or 'defaults')
      vector = method.merge(vectors, **reads, **settings)
      addition = evaluate.task_addition(
          evaluator, theta0, vector, heads=heads, val={t: data[t].val for t in names},
          test={t: data[t].test for t in names}, finetuned=finetuned,
          alphas=lambdas if method.scaled else [1.0])
      score = max(p['normalized_val'] for p in addition['curve'])
      if best is None or score > best[0]:
        best = (score, settings, addition, vector)
    score, settings, addition, vector = best
    _save_params(os.path.join(directory, 'params'), vector.apply_to(theta0, addition['alpha']))
    results[name] = {'method': name, 'hyperparameters': settings, 'lambda': addition['alpha'],
                     'normalized_val': score, 'test': addition['test'],
                     'normalized_test': addition['normalized_test'],
                     'mean_test': addition['mean_test'],
                     'mean_normalized_test': addition['mean_normalized_test'],
                     'seconds': time.time() - start}
    checkpoint.atomic_write_json(result_file, results[name])
    logging.info('%s/%s: mean test %.3f (normalized %.3f) with %s at lambda %s', regime, name,
                 addition['mean_test'], addition['mean_normalized_test'], settings,
                 addition['alpha'])
  summary = {'regime': regime, 'tasks': names, 'pretrained': pretrained,
             'finetuned': finetuned, 'methods': results}
  out = common.merge_dir(workdir, regime)
  checkpoint.atomic_write_json(os.path.join(out, 'results.json'), summary)
  checkpoint.atomic_write_bytes(os.path.join(out, 'report.md'),
                                report.merging_markdown(summary).encode())
  print(report.merging_table(summary))
  return summary


def _save_params(path: str, params) -> None:
  """The merged params as an orbax checkpoint (written to a temporary name, then renamed)."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(path), params, force=True)


if __name__ == '__main__':
  app.run(common.app_main(run))
