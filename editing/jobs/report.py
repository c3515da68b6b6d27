"""Human-readable views of the evaluation's results.json: console tables, markdown reports,
α-curve plots and weight-disentanglement heatmaps; and the table and figure helpers that the
merging reports (`merging.jobs.report`) share."""

import io

from editing import atomic

_COLUMNS = ('task', 'pretrained', 'fine-tuned', 'addition', 'addition (norm.)', 'negation target',
            'negation control')


def _rows(results: dict) -> list[list[str]]:
  add, neg = results['addition'], results['negation']
  rows = []
  for t in results['tasks']:
    rows.append([t, results['pretrained'][t], results['finetuned'][t]['test'], add['test'][t],
                 add['normalized_test'][t], neg[t]['target_test'], neg[t]['control_test']])
  columns = list(zip(*[r[1:] for r in rows]))
  rows.append(['mean'] + [sum(c) / len(c) for c in columns])
  return [[r[0]] + [f'{100 * v:.1f}' for v in r[1:]] for r in rows]


def fixed_width(header, rows) -> str:
  """Columns right-aligned to their widest cell, a rule under the header."""
  rows = [list(header)] + rows
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
  lines = ['  '.join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
  lines.insert(1, '-' * len(lines[0]))
  return '\n'.join(lines)


def markdown_table(header, rows) -> str:
  """A GitHub-flavoured markdown table."""
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  return '\n'.join(lines + ['| ' + ' | '.join(row) + ' |' for row in rows]) + '\n'


def table(results: dict) -> str:
  """A fixed-width table of test accuracies (%), one row per task and a mean row."""
  return fixed_width(_COLUMNS, _rows(results))


_COMPARISON_COLUMNS = ('regime', 'fine-tuned', 'addition', 'addition (norm.)',
                       'negation target', 'negation control', 'mean ξ')


# What a regime's row reports: means over its tasks of test accuracy, and its mean ξ.
SUMMARY = ('finetuned', 'addition', 'addition_normalized', 'negation_target', 'negation_control',
           'xi')


def summary(r: dict) -> dict[str, float | None]:
  """One regime's results as the SUMMARY numbers (accuracies as fractions; ξ None if no pair
  was measured)."""
  names = r['tasks']
  mean = lambda values: sum(values) / len(values)
  return {'finetuned': mean([r['finetuned'][t]['test'] for t in names]),
          'addition': r['addition']['mean_test'],
          'addition_normalized': r['addition']['mean_normalized_test'],
          'negation_target': mean([r['negation'][t]['target_test'] for t in names]),
          'negation_control': mean([r['negation'][t]['control_test'] for t in names]),
          'xi': r['disentanglement']['mean']}


def _cell(name: str, value: float | None) -> str:
  if value is None:
    return '–'
  return f'{value:.3f}' if name == 'xi' else f'{100 * value:.1f}'


def _comparison_rows(results: dict) -> list[list[str]]:
  return [[regime] + [_cell(k, v) for k, v in summary(r).items()]
          for regime, r in results['regimes'].items()]


def comparison_table(results: dict) -> str:
  """One row per regime: mean test accuracies (%) and mean disentanglement error."""
  return fixed_width(_COMPARISON_COLUMNS, _comparison_rows(results))


def comparison_markdown(results: dict) -> str:
  """The report over regimes: the comparison table, then each regime's own report."""
  control = results['control_task']
  out = io.StringIO()
  out.write('# Fine-tuning regimes on the built-in suite\n\n')
  out.write(markdown_table(_COMPARISON_COLUMNS, _comparison_rows(results)))
  out.write(f'\nMeans over the {len(results["tasks"])} tasks of test accuracy (%); negation '
            f'control is {control}. Mean ξ: the weight disentanglement error averaged over the '
            'grid and the task pairs (0 = adding the other task vector never changes a '
            'prediction, 2 = it always does).\n')
  for r in results['regimes'].values():
    out.write('\n' + markdown(r).replace('# ', '## ', 1))
  return out.getvalue()


def markdown(results: dict) -> str:
  """The report: the table, the chosen α's and what the columns mean."""
  add, neg = results['addition'], results['negation']
  negation_alphas = ', '.join(f'{t} {neg[t]["alpha"]}' for t in results['tasks'])
  control = results['control_task']
  control_accuracy = 100 * results['pretrained'][control]
  threshold = 100 * results['negation_threshold']
  out = io.StringIO()
  out.write(f'# Task arithmetic on the built-in suite ({results["regime"]} fine-tuning)\n\n')
  out.write(markdown_table(_COLUMNS, _rows(results)))
  out.write(f'\nTest accuracy (%). Addition: θ0 + α·Σ τ_t at α = {add["alpha"]} (chosen on '
            'validation by mean normalized accuracy); normalized = accuracy / the single-task '
            'fine-tuned accuracy. Negation: θ0 − α·τ_t, α per task '
            f'({negation_alphas}) minimising target validation accuracy while {control} (control) '
            f'keeps ≥ {threshold:g}% of its pretrained accuracy ({control_accuracy:.1f}%).\n')
  if 'linearity' in results:
    linear = results['linearity']
    out.write('\nLinearity (`editing.linearity`): the departure d(α) = ‖f(θ0 + ατ) − f(θ0) − α·Jτ‖ '
              '/ ‖α·Jτ‖ of each task vector on the other tasks\' test inputs, mean over tasks: ' +
              ', '.join(f'd({a:g}) = {d:.3f}' for a, d in zip(linear['alphas'], linear['mean'])) +
              '.\n')
  return out.getvalue()


def pyplot():
  """matplotlib's pyplot on the Agg backend, imported only when a figure is drawn."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save_png(fig, path: str) -> None:
  """Writes the figure as a PNG atomically and closes it."""
  buffer = io.BytesIO()
  fig.savefig(buffer, format='png', dpi=110)
  pyplot().close(fig)
  atomic.write_bytes(path, buffer.getvalue())


def plot_alpha_curves(results: dict, path: str) -> None:
  """Validation accuracy against α: addition (mean normalized) and negation (per task)."""
  plt = pyplot()
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  curve = results['addition']['curve']
  left.plot([p['alpha'] for p in curve], [p['normalized_val'] for p in curve], 'k-o', ms=3)
  left.axvline(results['addition']['alpha'], color='gray', ls=':')
  left.set(title='task addition', xlabel='α', ylabel='mean normalized val accuracy')
  for t in results['tasks']:
    curve = results['negation'][t]['curve']
    line, = right.plot([p['alpha'] for p in curve], [p['target_val'] for p in curve], '-',
                       label=t)
    right.plot([p['alpha'] for p in curve], [p['control_val'] for p in curve], ':',
               color=line.get_color())
  right.set(title='task negation (solid: target, dotted: control)', xlabel='α',
            ylabel='val accuracy')
  right.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  save_png(fig, path)


def plot_disentanglement(results: dict, path: str) -> None:
  """ξ(α1, α2) heatmaps, one per task pair, on the fixed scale [0, 2] that ξ spans, so that
  every regime's figure reads the same."""
  plt = pyplot()
  grid = results['disentanglement']['alphas']
  pairs = results['disentanglement']['xi']
  fig, axes = plt.subplots(1, len(pairs), figsize=(3.1 * len(pairs) + 1.2, 3.3), squeeze=False,
                           layout='constrained')
  half = (grid[-1] - grid[0]) / max(len(grid) - 1, 1) / 2  # pixels centred on the grid points
  extent = (grid[0] - half, grid[-1] + half, grid[0] - half, grid[-1] + half)
  for ax, (pair, xi) in zip(axes[0], pairs.items()):
    image = ax.imshow(xi, origin='lower', extent=extent, vmin=0.0, vmax=2.0, cmap='viridis')
    first, second = pair.split(':')
    ax.set(title=pair, xlabel=f'α ({second})', ylabel=f'α ({first})')
  fig.colorbar(image, ax=axes[0].tolist(), label='ξ')
  fig.suptitle(f'weight disentanglement error, {results["regime"]} fine-tuning')
  save_png(fig, path)
