r"""Evaluates the suite's task vectors: single-task, task addition and task negation.

  python -m launch.evaluate --workdir=workdir/quickstart [--config=configs/quickstart.py[:tiny]]

Reads the pretrained backbone and the task vectors that `launch.finetune` saved in the workdir;
writes <workdir>/results.json, report.md and alpha_curves.png.
"""

import os

import ml_collections
import numpy as np
from absl import app, logging

from editing import checkpoint
from editing import evaluate
from editing.data import suite
from launch import common
from launch import report
from merging import task_arithmetic


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs the task-arithmetic protocols on the workdir's task vectors and writes the results."""
  regime = config.finetune.regime
  names = common.tasks(config)
  common.use_compilation_cache(workdir)
  theta0, apply_fn = common.load_pretrained(workdir)
  missing = [t for t in names if not os.path.exists(common.task_vector_file(workdir, regime, t))]
  if missing:
    raise FileNotFoundError(f'no {regime} task vector for {missing} in {workdir}; run '
                            f'launch.finetune --task=<task> (or launch.quickstart) first')
  vectors = {t: checkpoint.load_task_vector(common.task_vector_file(workdir, regime, t))[0]
             for t in names}
  data = {t: common.load_task(config, t) for t in names + [suite.CONTROL_TASK]}
  heads = {t: common.head(config, workdir, data[t], theta0, apply_fn) for t in data}
  evaluator = common.evaluator(config, apply_fn, regime)
  alphas = evaluate.alpha_grid(config.eval.alpha_step)

  logging.info('single-task accuracies')
  pretrained, finetuned = {}, {}
  for t in data:
    pretrained[t] = evaluator.accuracy(theta0, theta0, heads[t], data[t].test)
    if t in vectors:
      params = evaluator.edit(theta0, vectors[t], 1.0)
      finetuned[t] = {split: evaluator.accuracy(theta0, params, heads[t], getattr(data[t], split))
                      for split in ('val', 'test')}

  logging.info('task addition of %d task vectors over %d values of alpha', len(names), len(alphas))
  addition = evaluate.task_addition(
      evaluator, theta0, task_arithmetic.merge(list(vectors.values())),
      heads={t: heads[t] for t in names},
      val={t: data[t].val for t in names}, test={t: data[t].test for t in names},
      finetuned=finetuned, alphas=alphas)

  negation = {}
  control = data[suite.CONTROL_TASK]
  for t in names:
    logging.info('task negation of %s', t)
    negation[t] = evaluate.task_negation(
        evaluator, theta0, vectors[t], head=heads[t], val=data[t].val, test=data[t].test,
        control_head=heads[suite.CONTROL_TASK],
        control_val=control.val.take(config.eval.control_val_size),
        control_test=control.test, alphas=alphas, threshold=config.eval.negation_threshold)

  results = {'regime': regime, 'tasks': names, 'control_task': suite.CONTROL_TASK,
             'pretrained': pretrained, 'finetuned': finetuned, 'addition': addition,
             'negation': negation}
  checkpoint.atomic_write_json(os.path.join(workdir, 'results.json'), results)
  checkpoint.atomic_write_bytes(os.path.join(workdir, 'report.md'),
                                report.markdown(results).encode())
  report.plot_alpha_curves(results, os.path.join(workdir, 'alpha_curves.png'))
  print(report.table(results))
  logging.info('mean single-task test accuracy: pretrained %.3f, fine-tuned %.3f',
               np.mean([pretrained[t] for t in names]),
               np.mean([finetuned[t]['test'] for t in names]))
  return results


if __name__ == '__main__':
  app.run(common.app_main(run))
