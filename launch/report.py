"""Human-readable views of results.json: a console table, a markdown report, α-curve plots."""

import io

from editing import checkpoint

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


def table(results: dict) -> str:
  """A fixed-width table of test accuracies (%), one row per task and a mean row."""
  rows = [list(_COLUMNS)] + _rows(results)
  widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
  lines = ['  '.join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
  lines.insert(1, '-' * len(lines[0]))
  return '\n'.join(lines)


def markdown(results: dict) -> str:
  """The report: the table, the chosen α's and what the columns mean."""
  add, neg = results['addition'], results['negation']
  negation_alphas = ', '.join(f'{t} {neg[t]["alpha"]}' for t in results['tasks'])
  control = results['control_task']
  control_accuracy = 100 * results['pretrained'][control]
  out = io.StringIO()
  out.write(f'# Task arithmetic on the built-in suite ({results["regime"]} fine-tuning)\n\n')
  out.write('| ' + ' | '.join(_COLUMNS) + ' |\n|' + '---|' * len(_COLUMNS) + '\n')
  for row in _rows(results):
    out.write('| ' + ' | '.join(row) + ' |\n')
  out.write(f'\nTest accuracy (%). Addition: θ0 + α·Σ τ_t at α = {add["alpha"]} (chosen on '
            'validation by mean normalized accuracy); normalized = accuracy / the single-task '
            'fine-tuned accuracy. Negation: θ0 − α·τ_t, α per task '
            f'({negation_alphas}) minimising target validation accuracy while {control} (control) '
            f'keeps ≥ 95% of its pretrained accuracy ({control_accuracy:.1f}%).\n')
  return out.getvalue()


def plot_alpha_curves(results: dict, path: str) -> None:
  """Validation accuracy against α: addition (mean normalized) and negation (per task)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

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
  buffer = io.BytesIO()
  fig.savefig(buffer, format='png', dpi=110)
  plt.close(fig)
  checkpoint.atomic_write_bytes(path, buffer.getvalue())
