"""The continual merging protocol (`merging.continual`), run by launch.merge where
config.merge.continual names methods.

The task vectors of a regime arrive in an order, one at a time. After each arrival the running
merge's model θ0 + vector is scored on the test sets of the tasks seen so far, and their mean
accuracy is that step's; after the last, on every task. Each method runs over
config.merge.orders orders: the experiment's own task order, then random permutations drawn
from config.merge.seed, the same for every method. No λ is chosen on validation: each method
runs at its authors' settings (`merging.continual.METHODS`), as the protocol has no stored
vectors to tune on.

Writes <workdir>/merge/<regime>/continual.json (per method and order: the order, the mean
accuracy after each step and the final per-task accuracies), continual.md (the mean over
orders after each step, and the final mean ± std) and continual.png (the curves).
"""

import os

import numpy as np
from absl import logging

from editing import atomic
from editing import settings as settings_lib
from editing.errors import UserError
from editing.jobs import experiment
from editing.jobs import report as report_lib
from editing.jobs import workdir as workdir_lib
from editing.progress import Progress
from merging import continual


def methods_from(value: str) -> list[str]:
  names = [m.strip() for m in value.split(',') if m.strip()]
  unknown = [m for m in names if m not in continual.METHODS]
  if unknown:
    raise UserError(f'config.merge.continual: {unknown} are not continual methods; known: '
                    f'{sorted(continual.METHODS)}')
  return names


def orders(names: list[str], count: int, seed: int) -> list[list[str]]:
  """The task order of the experiment, then count − 1 random permutations."""
  rng = np.random.default_rng(seed)
  return [list(names)] + [[names[i] for i in rng.permutation(len(names))]
                          for _ in range(count - 1)]


def run_regime(exp: experiment.Experiment, regime: str, methods: list[str], count: int,
               seed: int) -> dict:
  """Every continual method over `count` orders of one regime's vectors; writes the report."""
  theta0, names = exp.theta0, exp.tasks
  vectors = {t: v.materialized(theta0) for t, v in exp.vectors(regime).items()}
  evaluator, data, heads = exp.evaluator(regime), exp.data(), exp.heads()
  task_orders = orders(names, count, seed)
  results = {}
  progress = Progress(f'{regime}: continual merging', len(methods) * count, unit='orders')
  for name in methods:
    values = settings_lib.check(continual.METHODS[name][1], {}, f'continual.{name}')
    runs = []
    for order in task_orders:
      steps = continual.run(name, [vectors[t] for t in order], values)
      curve, final = [], {}
      for t, vector in enumerate(steps):
        seen = order[:t + 1]
        accuracy = evaluator.accuracies(theta0, vector.apply_to(theta0),
                                        {s: (heads[s], data[s].test) for s in seen})
        curve.append(float(np.mean(list(accuracy.values()))))
        final = accuracy
      runs.append({'order': order, 'curve': curve, 'final': final})
      progress.advance()
    results[name] = {'settings': values, 'runs': runs}
    logging.info('%s/continual %s: final mean %.3f over %d orders', regime, name,
                 np.mean([r['curve'][-1] for r in runs]), count)
  summary = {'regime': regime, 'tasks': names, 'seed': seed, 'methods': results}
  out = workdir_lib.merge_dir(exp.workdir, regime)
  os.makedirs(out, exist_ok=True)
  atomic.write_json(os.path.join(out, 'continual.json'), summary)
  atomic.write_bytes(os.path.join(out, 'continual.md'), markdown(summary).encode())
  _plot(summary, os.path.join(out, 'continual.png'))
  print(markdown(summary))
  return summary


def markdown(summary: dict) -> str:
  """The mean over orders of the mean accuracy after each step, and the final mean ± std."""
  steps = len(summary['tasks'])
  header = (['method'] + [f'after {t + 1}' for t in range(steps)] +
            ['final (mean ± std over orders)'])
  rows = []
  for name, result in summary['methods'].items():
    curves = np.array([r['curve'] for r in result['runs']]) * 100
    rows.append([name] + [f'{v:.1f}' for v in curves.mean(axis=0)] +
                [f'{curves[:, -1].mean():.1f} ± {curves[:, -1].std():.1f}'])
  runs = next(iter(summary['methods'].values()))['runs']
  return (f'# Continual merging ({summary["regime"]} task vectors)\n\n' +
          report_lib.markdown_table(header, rows) +
          f'\nMean test accuracy (%) over the tasks seen after each arrival, averaged over '
          f'{len(runs)} task orders: {"; ".join(" → ".join(r["order"]) for r in runs)}.\n')


def _plot(summary: dict, path: str) -> None:
  plt = report_lib.pyplot()
  fig, axis = plt.subplots(figsize=(6, 4))
  for name, result in summary['methods'].items():
    curves = np.array([r['curve'] for r in result['runs']]) * 100
    axis.plot(range(1, curves.shape[1] + 1), curves.mean(axis=0), '-o', ms=3, label=name)
  axis.set(xlabel='tasks merged', ylabel='mean accuracy on the tasks seen (%)',
           title=f'continual merging, {summary["regime"]}')
  axis.legend()
  report_lib.save_png(fig, path)
