"""Human-readable views of results.json: console tables, markdown reports, α-curve plots and
weight-disentanglement heatmaps."""

import io

import numpy as np

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


def _fixed_width(header, rows) -> str:
  rows = [list(header)] + rows
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
  lines = ['  '.join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
  lines.insert(1, '-' * len(lines[0]))
  return '\n'.join(lines)


def _markdown_table(header, rows) -> str:
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  return '\n'.join(lines + ['| ' + ' | '.join(row) + ' |' for row in rows]) + '\n'


def table(results: dict) -> str:
  """A fixed-width table of test accuracies (%), one row per task and a mean row."""
  return _fixed_width(_COLUMNS, _rows(results))


_COMPARISON_COLUMNS = ('regime', 'fine-tuned', 'addition', 'addition (norm.)',
                       'negation target', 'negation control', 'mean ξ')


def _comparison_rows(results: dict) -> list[list[str]]:
  rows = []
  for regime, r in results['regimes'].items():
    names = r['tasks']
    mean = lambda values: 100 * sum(values) / len(values)
    xi = r['disentanglement']['mean']
    rows.append([regime,
                 f'{mean([r["finetuned"][t]["test"] for t in names]):.1f}',
                 f'{100 * r["addition"]["mean_test"]:.1f}',
                 f'{100 * r["addition"]["mean_normalized_test"]:.1f}',
                 f'{mean([r["negation"][t]["target_test"] for t in names]):.1f}',
                 f'{mean([r["negation"][t]["control_test"] for t in names]):.1f}',
                 '–' if xi is None else f'{xi:.3f}'])
  return rows


def comparison_table(results: dict) -> str:
  """One row per regime: mean test accuracies (%) and mean disentanglement error."""
  return _fixed_width(_COMPARISON_COLUMNS, _comparison_rows(results))


def comparison_markdown(results: dict) -> str:
  """The report over regimes: the comparison table, then each regime's own report."""
  control = results['control_task']
  out = io.StringIO()
  out.write('# Fine-tuning regimes on the built-in suite\n\n')
  out.write(_markdown_table(_COMPARISON_COLUMNS, _comparison_rows(results)))
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
  out = io.StringIO()
  out.write(f'# Task arithmetic on the built-in suite ({results["regime"]} fine-tuning)\n\n')
  out.write(_markdown_table(_COLUMNS, _rows(results)))
  out.write(f'\nTest accuracy (%). Addition: θ0 + α·Σ τ_t at α = {add["alpha"]} (chosen on '
            'validation by mean normalized accuracy); normalized = accuracy / the single-task '
            'fine-tuned accuracy. Negation: θ0 − α·τ_t, α per task '
            f'({negation_alphas}) minimising target validation accuracy while {control} (control) '
            f'keeps ≥ 95% of its pretrained accuracy ({control_accuracy:.1f}%).\n')
  return out.getvalue()


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  return pyplot


def _save_png(fig, path: str) -> None:
  buffer = io.BytesIO()
  fig.savefig(buffer, format='png', dpi=110)
  _pyplot().close(fig)
  checkpoint.atomic_write_bytes(path, buffer.getvalue())


def plot_alpha_curves(results: dict, path: str) -> None:
  """Validation accuracy against α: addition (mean normalized) and negation (per task)."""
  plt = _pyplot()
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
  _save_png(fig, path)


def plot_disentanglement(results: dict, path: str) -> None:
  """ξ(α1, α2) heatmaps, one per task pair, on the fixed scale [0, 2] that ξ spans, so that
  every regime's figure reads the same."""
  plt = _pyplot()
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
  _save_png(fig, path)


def _merging_rows(summary: dict) -> list[list[str]]:
  names = summary['tasks']
  percent = lambda x: f'{100 * x:.1f}'
  rows = [['pretrained'] + [percent(summary['pretrained'][t]) for t in names] +
          [percent(np.mean([summary['pretrained'][t] for t in names])), '', '', ''],
          ['fine-tuned (each task)'] +
          [percent(summary['finetuned'][t]['test']) for t in names] +
          [percent(np.mean([summary['finetuned'][t]['test'] for t in names])), '100.0', '', '']]
  ranked = sorted(summary['methods'].values(), key=lambda r: -r['mean_normalized_test'])
  for r in ranked:
    settings = ', '.join(f'{k}={v}' for k, v in r['hyperparameters'].items()
                         if k in _TUNED.get(r['method'], ()))
    rows.append([r['method']] + [percent(r['test'][t]) for t in names] +
                [percent(r['mean_test']), percent(r['mean_normalized_test']), str(r['lambda']),
                 settings])
  return rows


# The settings worth showing in the table: those a grid may choose.
_TUNED = {'ties': ('k', 'scope'), 'dare': ('p', 'then'), 'breadcrumbs': ('top', 'bottom'),
          'consensus': ('k', 'tall_lambda'), 'regmean': ('alpha',)}


def _merging_header(summary: dict) -> list[str]:
  return ['method'] + list(summary['tasks']) + ['mean', 'mean (norm.)', 'λ', 'chosen']


def merging_table(summary: dict) -> str:
  """Per-task and mean test accuracy (%) of every merge, best mean normalized first."""
  return _fixed_width(_merging_header(summary), _merging_rows(summary))


def merging_markdown(summary: dict) -> str:
  out = io.StringIO()
  out.write(f'# Merging {len(summary["tasks"])} task vectors ({summary["regime"]} fine-tuning)'
            '\n\n')
  out.write(_markdown_table(_merging_header(summary), _merging_rows(summary)))
  out.write('\nTest accuracy (%), methods sorted by mean normalized accuracy (accuracy / each '
            'task\'s own fine-tuned accuracy). λ and the chosen hyperparameters were selected '
            'on validation; λ = 1 for the merges that are not scaled (averages, AdaMerging).\n')
  return out.getvalue()


def _mean_std(values) -> str:
  values = 100 * np.asarray(values, np.float64)
  return f'{values.mean():.1f} ± {values.std():.1f}' if len(values) > 1 else f'{values[0]:.1f}'


_SAFETY_HEADER = ('trigger', 'poisoned', 'method', 'clean accuracy', 'ASR succession',
                  'ASR transfer')


def _safety_groups(summary: dict) -> dict:
  """(trigger, poisoned tasks, method) -> that merge's results over the seeds, in run order."""
  groups = {}
  for r in summary['merges']:
    groups.setdefault((r['trigger'], ','.join(r['poisoned']), r['method']), []).append(r)
  return groups


def _safety_rows(summary: dict) -> list[list[str]]:
  rows = []
  for (trigger, poisoned, method), runs in _safety_groups(summary).items():
    rows.append([trigger, poisoned, method, _mean_std([r['mean_test'] for r in runs]),
                 _mean_std([r['succession'] for r in runs]),
                 _mean_std([r['transfer'] for r in runs])])
  return rows


_ATTACK_HEADER = ('fine-tune', 'clean accuracy', 'poisoned accuracy', 'ASR')


def _attack_rows(summary: dict) -> list[list[str]]:
  """Each poisoned single-task model against the clean fine-tune of its seed."""
  rows = []
  per_seed = list(summary['fine_tunes'].values())
  for trigger in summary['triggers']:
    for task in summary['victims'][:max(summary['counts'])]:
      rows.append([f'{trigger}/{task}',
                   _mean_std([a[f'clean/{task}']['test'] for a in per_seed]),
                   _mean_std([a[f'{trigger}/{task}']['test'] for a in per_seed]),
                   _mean_std([a[f'{trigger}/{task}']['asr'][trigger] for a in per_seed])])
  return rows


def safety_table(summary: dict) -> str:
  """The attacks alone, then every merge: clean accuracy and ASR (%), mean ± std over seeds."""
  return (_fixed_width(_ATTACK_HEADER, _attack_rows(summary)) + '\n\n' +
          _fixed_width(_SAFETY_HEADER, _safety_rows(summary)))


def safety_markdown(summary: dict) -> str:
  out = io.StringIO()
  names = summary['tasks']
  out.write(f'# Backdoors through merging ({summary["regime"]} fine-tuning, tasks '
            f'{", ".join(names)}; target class {summary["target"]}; seeds '
            f'{", ".join(map(str, summary["seeds"]))})\n\n')
  out.write('## The attacks: each poisoned model alone, on its own task\n\n')
  out.write(_markdown_table(_ATTACK_HEADER, _attack_rows(summary)))
  pretrained = summary['pretrained']
  out.write(f'\nPretrained model: mean clean accuracy '
            f'{100 * np.mean(list(pretrained["test"].values())):.1f}%; ASR ' +
            ', '.join(f'{g} {100 * np.mean(list(pretrained["asr"][g].values())):.1f}%'
                      for g in summary['triggers']) + ' (the target rate with no backdoor).\n')
  out.write('\n## Merges\n\n')
  out.write(_markdown_table(_SAFETY_HEADER, _safety_rows(summary)))
  out.write('\nMean over tasks of clean test accuracy (%); ASR (%) = share of triggered test '
            'inputs not of the target class that are classified as the target, averaged over '
            'the poisoned tasks (succession) and the clean ones (transfer). Mean ± std over '
            'seeds.\n')
  return out.getvalue()


def plot_safety(summary: dict, path: str) -> None:
  """Clean accuracy against succession ASR, one panel per scenario, one point per method
  (mean over seeds, bars: std)."""
  plt = _pyplot()
  groups = _safety_groups(summary)
  scenarios = list(dict.fromkeys(k[:2] for k in groups))
  fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 4), squeeze=False,
                           layout='constrained')
  colours = {m: plt.get_cmap('tab10')(i % 10) for i, m in enumerate(summary['methods'])}
  for ax, (trigger, poisoned) in zip(axes[0], scenarios):
    for (g, p, method), runs in groups.items():
      if (g, p) != (trigger, poisoned):
        continue
      asr = 100 * np.array([r['succession'] for r in runs])
      accuracy = 100 * np.array([r['mean_test'] for r in runs])
      ax.errorbar(asr.mean(), accuracy.mean(), xerr=asr.std(), yerr=accuracy.std(), fmt='o',
                  color=colours[method], label=method, capsize=2)
    ax.set(title=f'{trigger}: {poisoned} poisoned', xlabel='ASR, poisoned tasks (%)',
           ylabel='mean clean accuracy (%)')
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc='outside right center', fontsize=8)
  _save_png(fig, path)
