"""The recipe search's tables and figure: every point's validation score, and each regime at
its recipe over the fine-tuning seeds (mean ± standard deviation, overall and per task)."""

import numpy as np

from editing.jobs import report


def over_seeds(by_seed: dict[int, dict]) -> dict:
  """{regime: {'seeds': [...], 'per_seed': {number: [one per seed]}, 'mean': {...}, 'std':
  {...}, 'per_task': {number: {task: mean over seeds}}}} of the `report.summary` numbers; std
  is the sample standard deviation (ddof 1; 0 for one seed). The per-task means (test
  accuracy fine-tuned, added, and of the negated target) show where a regime's means are
  won or lost."""
  seeds = list(by_seed)
  out = {}
  for regime in by_seed[seeds[0]]['regimes']:
    runs = [by_seed[s]['regimes'][regime] for s in seeds]
    rows = [report.summary(r) for r in runs]
    per_seed = {k: [row[k] for row in rows] for k in report.SUMMARY}
    measured = {k: [v for v in values if v is not None] for k, values in per_seed.items()}
    per_task = {number: {t: float(np.mean([of(r, t) for r in runs])) for t in runs[0]['tasks']}
                for number, of in _PER_TASK.items()}
    out[regime] = {
        'seeds': seeds, 'per_seed': per_seed,
        'mean': {k: float(np.mean(v)) if v else None for k, v in measured.items()},
        'std': {k: float(_std(v)) if v else None for k, v in measured.items()},
        'per_task': per_task}
  return out


_PER_TASK = {'pretrained': lambda r, t: r['pretrained'][t],
             'finetuned': lambda r, t: r['finetuned'][t]['test'],
             'addition': lambda r, t: r['addition']['test'][t],
             'negation_target': lambda r, t: r['negation'][t]['target_test']}


def plot_spread(by_seed: dict[int, dict], path: str) -> None:
  """Each regime's validation curves against α, the mean over seeds with ± one standard
  deviation shaded: addition (mean normalized accuracy) and negation (mean target accuracy over
  tasks, and dashed the control's, which bounds the α negation may use); and its mean ξ with
  the same spread."""
  plt = report.pyplot()
  fig, (addition, negation, xi) = plt.subplots(1, 3, figsize=(15, 4))
  seeds = list(by_seed)
  for i, regime in enumerate(by_seed[seeds[0]]['regimes']):
    runs, colour = [by_seed[s]['regimes'][regime] for s in seeds], f'C{i}'
    curve = runs[0]['addition']['curve']
    _band(addition, regime, colour, [p['alpha'] for p in curve],
          [[p['normalized_val'] for p in r['addition']['curve']] for r in runs])
    curve = runs[0]['negation'][runs[0]['tasks'][0]]['curve']
    for accuracy, label, style in (('target_val', regime, '-'), ('control_val', None, '--')):
      _band(negation, label, colour, [p['alpha'] for p in curve],
            [np.mean([[p[accuracy] for p in r['negation'][t]['curve']] for t in r['tasks']],
                     axis=0) for r in runs], style)
    means = [r['disentanglement']['mean'] for r in runs]
    if None not in means:
      xi.errorbar([regime], [np.mean(means)], yerr=[_std(means)], fmt='o', capsize=4,
                  color=colour)
  addition.set(title='task addition', xlabel='α', ylabel='mean normalized val accuracy')
  negation.set(title='task negation: target, control (dashed)', xlabel='α',
               ylabel='mean val accuracy')
  xi.set(title='weight disentanglement', ylabel='mean ξ')
  xi.tick_params(axis='x', labelrotation=20)
  addition.legend(fontsize=8)
  fig.suptitle(f'mean ± std over {len(seeds)} fine-tuning seeds')
  fig.tight_layout()
  report.save_png(fig, path)


def _band(ax, label: str | None, colour: str, alphas: list[float], curves: list,
          style: str = '-') -> None:
  """The mean of `curves` (one per seed) against `alphas`, ± one standard deviation shaded."""
  mean, std = np.mean(curves, axis=0), _std(curves)
  ax.plot(alphas, mean, style, color=colour, label=label)
  ax.fill_between(alphas, mean - std, mean + std, color=colour, alpha=0.2)


def _std(values) -> np.ndarray:
  """The sample standard deviation over the first axis (0 for one value)."""
  values = np.asarray(values, dtype=float)
  return np.std(values, axis=0, ddof=1) if len(values) > 1 else np.zeros(values.shape[1:])


def _seed_rows(search: dict, spread: dict) -> tuple[tuple[str, ...], list[list[str]]]:
  """Each regime at its chosen recipe: mean ± std over the seeds of every summary number."""
  header = ('regime', 'lr', 'steps', 'seeds', 'fine-tuned', 'addition', 'addition (norm.)',
            'negation target', 'negation control', 'mean ξ')
  rows = []
  for regime, r in spread.items():
    chosen = search[regime]['chosen']
    cells = []
    for k in report.SUMMARY:
      scale, digits = (1, 3) if k == 'xi' else (100, 1)
      cells.append('–' if r['mean'][k] is None else
                   f'{scale * r["mean"][k]:.{digits}f} ± {scale * r["std"][k]:.{digits}f}')
    rows.append([regime, f'{chosen["learning_rate"]:g}', str(chosen['steps']),
                 str(len(r['seeds']))] + cells)
  return header, rows


def seed_table(search: dict, spread: dict) -> str:
  return report.fixed_width(*_seed_rows(search, spread))


def _per_task_rows(spread: dict, cell) -> tuple[tuple[str, ...], list[list[str]]]:
  """A row per regime, a column per task, each cell `cell` of that task's per-task means (%)."""
  pretrained = next(iter(spread.values()))['per_task']['pretrained']
  rows = [['pretrained'] + [f'{100 * p:.1f}' for p in pretrained.values()]]
  for regime, r in spread.items():
    rows.append([regime] + [cell({k: 100 * v[t] for k, v in r['per_task'].items()})
                            for t in pretrained])
  return ('regime',) + tuple(pretrained), rows


def markdown(search: dict, spread: dict) -> str:
  """report.md: every point's mean validation accuracy (the chosen ones in bold), then each
  regime at its recipe over the seeds, overall and per task."""
  steps = sorted({p['steps'] for r in search.values() for p in r['points']})
  rows = []
  for regime, result in search.items():
    by_point = {(p['learning_rate'], p['steps']): p for p in result['points']}
    for rate in sorted({p['learning_rate'] for p in result['points']}):
      cells = []
      for n in steps:
        p = by_point.get((rate, n))
        cell = '' if p is None else f'{100 * p["mean_val"]:.1f}'
        cells.append(f'**{cell}**' if p == result['chosen'] else cell)
      rows.append([regime, f'{rate:g}'] + cells)
  return ('# Each regime at its own recipe\n\n'
          'Mean validation accuracy (%) over the tasks of each single-task fine-tune, at each '
          'point of the grid; the chosen point in bold.\n\n'
          + report.markdown_table(('regime', 'lr') + tuple(f'{n} steps' for n in steps), rows)
          + '\nAt the chosen recipes: test accuracy (%) and mean ξ, mean ± standard deviation '
          'over the fine-tuning seeds.\n\n'
          + report.markdown_table(*_seed_rows(search, spread))
          + '\nPer task, test accuracy (%) fine-tuned → under addition, mean over the seeds.\n\n'
          + report.markdown_table(*_per_task_rows(
              spread, lambda m: f'{m["finetuned"]:.1f} → {m["addition"]:.1f}'))
          + '\nPer task, the target\'s test accuracy (%) after negation, mean over the seeds.\n\n'
          + report.markdown_table(*_per_task_rows(
              spread, lambda m: f'{m["negation_target"]:.1f}')))


def at_edge(result: dict) -> list[str]:
  """Which of the chosen point's settings lie at an end of a range of three or more searched
  values (a wider range might choose past them; of two values, either is an end)."""
  edges = []
  for setting in ('learning_rate', 'steps'):
    values = sorted({p[setting] for p in result['points']})
    if len(values) > 2 and result['chosen'][setting] in (values[0], values[-1]):
      edges.append(setting)
  return edges


def table(search: dict) -> str:
  """Every point's mean validation accuracy per regime (and its addition's, normalized, where
  recorded), the chosen one marked (and where its settings are on the grid's edge), and the
  point the other criterion would choose."""
  lines = [f'{"regime":>15} {"lr":>8} {"steps":>6} {"mean val":>9} {"addition val":>13}']
  for regime, result in search.items():
    edges = at_edge(result)
    others = {by: p for by, p in result.get('choices', {}).items() if p != result['chosen']}
    for p in result['points']:
      mark = ''
      if p == result['chosen']:
        mark = '  <- chosen' + (f' ({" and ".join(edges)} on the grid\'s edge)' if edges else '')
      mark += ''.join(f'  <- by {by}' for by, other in others.items() if p == other)
      addition = (f'{100 * p["addition_val"]:13.1f}' if p.get('addition_val') is not None
                  else f'{"":>13}')
      lines.append(f'{regime:>15} {p["learning_rate"]:8.0e} {p["steps"]:6d} '
                   f'{100 * p["mean_val"]:9.1f} {addition}{mark}')
  return '\n'.join(lines)
