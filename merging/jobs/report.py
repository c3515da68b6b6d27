"""Human-readable views of the merge and safety results: tables, markdown reports, the
clean-accuracy-against-ASR scatter."""

import io

import numpy as np

from editing.jobs.report import fixed_width, markdown_table, pyplot, save_png


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
    # The settings worth showing: those the grid chose among.
    if r.get('per_task'):  # a setting per task, each chosen on that task's validation
      chosen = [f'{k}=' + '/'.join(str(r['hyperparameters'][t][k]) for t in names)
                for k in r['swept']]
    else:
      chosen = [f'{k}={r["hyperparameters"][k]}' for k in r['swept']]
    if 'lines' in r:  # LiNeS' depth scaling in place of one λ
      chosen.append('α={alpha:.3g}, β={beta}'.format(**r['lines']))
    rows.append([r['method']] + [percent(r['test'][t]) for t in names] +
                [percent(r['mean_test']), percent(r['mean_normalized_test']),
                 '' if 'lines' in r else str(r['lambda']), ', '.join(chosen)])
  return rows


def _merging_header(summary: dict) -> list[str]:
  return ['method'] + list(summary['tasks']) + ['mean', 'mean (norm.)', 'λ', 'chosen']


def merging_table(summary: dict) -> str:
  """Per-task and mean test accuracy (%) of every merge, best mean normalized first."""
  return fixed_width(_merging_header(summary), _merging_rows(summary))


def merging_markdown(summary: dict) -> str:
  out = io.StringIO()
  out.write(f'# Merging {len(summary["tasks"])} task vectors ({summary["regime"]} fine-tuning)'
            '\n\n')
  out.write(markdown_table(_merging_header(summary), _merging_rows(summary)))
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
  return (fixed_width(_ATTACK_HEADER, _attack_rows(summary)) + '\n\n' +
          fixed_width(_SAFETY_HEADER, _safety_rows(summary)))


def safety_markdown(summary: dict) -> str:
  out = io.StringIO()
  names = summary['tasks']
  out.write(f'# Backdoors through merging ({summary["regime"]} fine-tuning, tasks '
            f'{", ".join(names)}; target class {summary["target"]}; seeds '
            f'{", ".join(map(str, summary["seeds"]))})\n\n')
  out.write('## The attacks: each poisoned model alone, on its own task\n\n')
  out.write(markdown_table(_ATTACK_HEADER, _attack_rows(summary)))
  pretrained = summary['pretrained']
  out.write(f'\nPretrained model: mean clean accuracy '
            f'{100 * np.mean(list(pretrained["test"].values())):.1f}%; ASR ' +
            ', '.join(f'{g} {100 * np.mean(list(pretrained["asr"][g].values())):.1f}%'
                      for g in summary['triggers']) + ' (the target rate with no backdoor).\n')
  out.write('\n## Merges\n\n')
  out.write(markdown_table(_SAFETY_HEADER, _safety_rows(summary)))
  out.write('\nMean over tasks of clean test accuracy (%); ASR (%) = share of triggered test '
            'inputs not of the target class that are classified as the target, averaged over '
            'the poisoned tasks (succession) and the clean ones (transfer). Mean ± std over '
            'seeds.\n')
  return out.getvalue()


def plot_safety(summary: dict, path: str) -> None:
  """Clean accuracy against succession ASR, one panel per scenario, one point per method
  (mean over seeds, bars: std)."""
  plt = pyplot()
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
  save_png(fig, path)
