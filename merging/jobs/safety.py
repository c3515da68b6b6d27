"""Backdoors through merging: poisoned task vectors merged by each method, clean accuracy and ASR.

For every seed of the sweep `config.sweep.seed` (`editing.sweep`: each seed sets
config.finetune.seed, config.poison.seed and config.merge.seed, which the config leaves unset;
without that axis, the config's own seeds make one run; the backbone is shared): every task is
fine-tuned clean, and every victim task once per trigger on its poisoned training set
(config.poison: rate, target). A scenario (trigger, n) merges the first n victims' poisoned
vectors with the other tasks' clean ones. Each method is chosen as in `merging.jobs.merge`
(hyperparameters and λ on clean validation accuracy: the defender knows no trigger) and then
scored on the clean test sets and on the triggered ones: succession = mean ASR over the
poisoned tasks, transfer = mean ASR over the clean tasks.
Every method of `merging.REGISTRY` may run, DAM's ablations and its oracle (handed the true
trigger) included.

Writes <workdir>/safety/results.json, report.md (mean ± std over seeds) and scatter.png;
each merge's result.json is reused on a rerun with the same settings.
"""

import copy
import functools
import json
import os
import time

import ml_collections
import numpy as np
from absl import logging

from editing import atomic
from editing import evaluate
from editing import sweep
from editing.data import triggers
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import experiment
from editing.jobs import finetune
from editing.jobs import pretrain
from editing.jobs import workdir as workdir_lib
from editing.progress import Progress
from merging.jobs import inputs as inputs_lib
from merging.jobs import merge
from merging.jobs import report

# The settings of config.safety; and the seeds one seed of config.sweep.seed sets.
SECTION = ('victims', 'poisoned_counts', 'triggers', 'methods')
SEEDED = ('finetune.seed', 'poison.seed', 'merge.seed')


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  checks.validate(config, {**pretrain.SECTIONS, **finetune.SECTIONS, **merge.SECTIONS})
  unknown = sorted(set(config.safety) - set(SECTION))
  if unknown:
    raise UserError(f'config.safety.{unknown[0]} is not a setting of the safety experiment; its '
                    f'settings: {list(SECTION)} (its seeds: config.sweep.seed)')
  names = experiment.tasks(config)
  regime = _regime(config)
  victims = experiment.names_from(config.safety.victims, key='config.safety.victims', kind='task',
                              known=names)
  counts = [int(c) for c in config.safety.poisoned_counts.split(',')]
  if not all(1 <= c <= len(victims) and c < len(names) for c in counts):
    raise UserError(f'config.safety.poisoned_counts: each count must be at least 1, at most the '
                     f'{len(victims)} victims and fewer than the {len(names)} tasks; got {counts}')
  trigger_names = experiment.names_from(config.safety.triggers, key='config.safety.triggers',
                                        kind='trigger', known=list(triggers.REGISTRY))
  methods = merge.methods_from(config.safety.methods, key='config.safety.methods')
  for m in methods:
    merge.hyperparameter_grid(config, m)
  seeds = seed_list(config)

  pretrain.run(config, workdir)
  exp = experiment.Experiment.load(config, workdir)
  theta0, apply_fn = exp.theta0, exp.apply_fn
  data, heads, evaluator = exp.data(), exp.heads(), exp.evaluator(regime.name)
  trigger_fns = {g: experiment.trigger(config, g) for g in trigger_names}
  triggered = {g: {t: data[t].test.with_trigger(trigger_fns[g]) for t in names}
               for g in trigger_names}
  target = config.poison.target

  def attack_success(params, trigger_name, tasks=names):
    predicted = evaluator.predict(theta0, params,
                                  {t: (heads[t], triggered[trigger_name][t]) for t in tasks})
    return {t: evaluate.attack_success_rate(predicted[t], data[t].test.labels, target)
            for t in tasks}

  pretrained = {'test': evaluator.accuracies(theta0, theta0,
                                             {t: (heads[t], data[t].test) for t in names}),
                'asr': {g: attack_success(theta0, g) for g in trigger_names}}
  # All fine-tunes first, then the scenarios, each over every seed: an interrupted run has
  # whole scenarios done, and a rerun picks up where it stopped.
  vectors, fine_tunes = {}, {}
  for seed in seeds:
    seeded = _seeded(config, seed)
    seed_dir = os.path.join(workdir_lib.safety_dir(workdir), f'seed_{seed}')
    fine_tunes[seed] = {}  # each fine-tuned model alone: the attack's strength and its cost
    for g, t in [(None, t) for t in names] + [(g, t) for g in trigger_names
                                              for t in victims[:max(counts)]]:
      vector = finetune.run(_poisoning(seeded, g, t), workdir, t, regime,
                            directory=os.path.join(seed_dir, g or 'clean', t))
      vectors[seed, g, t] = vector
      params = vector.apply_to(theta0)
      fine_tunes[seed][f'{g or "clean"}/{t}'] = {
          'test': evaluator.accuracy(theta0, params, heads[t], data[t].test),
          'asr': {h: attack_success(params, h, [t])[t] for h in trigger_names}}
  summary = {'regime': regime.name, 'tasks': names, 'victims': victims, 'counts': counts,
             'triggers': trigger_names, 'target': target, 'seeds': seeds, 'methods': methods,
             'pretrained': pretrained, 'fine_tunes': fine_tunes, 'merges': []}
  progress = Progress('safety merges', len(trigger_names) * len(counts) * len(seeds)
                      * len(methods), unit='merges')
  for g in trigger_names:
    for count in counts:
      poisoned = victims[:count]
      for seed in seeds:
        seeded = _seeded(config, seed)
        scenario = [vectors[seed, g if t in poisoned else None, t] for t in names]
        finetuned = evaluate.finetuned_accuracy(evaluator, theta0, scenario, heads, data)
        inputs = inputs_lib.MergeInputs(seeded, regime.encoder(apply_fn), theta0, apply_fn, heads,
                                       data, extra={'trigger': trigger_fns[g]})
        for name in methods:
          directory = os.path.join(workdir_lib.safety_dir(workdir), f'seed_{seed}',
                                   f'{g}_{count}', name)
          result = _merge_and_attack(seeded, name, scenario, inputs, evaluator, finetuned,
                                     directory, functools.partial(attack_success,
                                                                  trigger_name=g), poisoned)
          summary['merges'].append({'seed': seed, 'trigger': g, 'poisoned': poisoned, **result})
          progress.advance()
      # The reports so far, rewritten after every scenario: a stopped run still has them.
      _write_reports(summary, workdir_lib.safety_dir(workdir))
  print(report.safety_table(summary))
  return summary


def _write_reports(summary: dict, out: str) -> None:
  atomic.write_json(os.path.join(out, 'results.json'), summary)
  atomic.write_bytes(os.path.join(out, 'report.md'),
                     report.safety_markdown(summary).encode())
  report.plot_safety(summary, os.path.join(out, 'scatter.png'))


def _merge_and_attack(config, name, vectors, inputs, evaluator, finetuned, directory,
                      attack_success, poisoned) -> dict:
  """One method's merge of one scenario: clean test accuracy at the chosen λ, and ASR."""
  result_file = os.path.join(directory, 'result.json')
  settings = {**merge.settings_used(config, name), 'poison': config.poison.to_dict(),
              'poisoned': poisoned, 'tasks': [v.tasks[0] for v in vectors]}
  if workdir_lib.reusable_result(directory, settings, result_file):
    with open(result_file) as f:
      return json.load(f)
  start = time.time()
  chosen = merge.best_merge(config, name, vectors, inputs, evaluator, finetuned)
  asr = attack_success(chosen.params)
  clean = [t for t in asr if t not in poisoned]
  result = {'method': name, **chosen.summary, 'asr': asr,
            'succession': float(np.mean([asr[t] for t in poisoned])),
            'transfer': float(np.mean([asr[t] for t in clean])),
            'seconds': time.time() - start}
  atomic.write_json(result_file, result)
  logging.info('%s: clean %.3f, succession ASR %.3f, transfer ASR %.3f', name,
               result['mean_test'], result['succession'], result['transfer'])
  return result


def _regime(config):
  regimes = experiment.configured_regimes(config)
  if len(regimes) != 1:
    raise UserError(f'config.regimes: the safety experiment runs one regime, got '
                     f'{[r.name for r in regimes]}')
  return regimes[0]


def seed_list(config: ml_collections.ConfigDict) -> list[int]:
  """The seeds of config.sweep.seed, each a fine-tuning seed (`finetune.TRAINING`); without
  that axis, the one seed config.finetune.seed. A seed the axis sets that the config also
  gives is refused."""
  axis = sweep.axes(config, 'seed').get('seed')
  if axis is None and config.finetune.seed is None:
    raise UserError('config.sweep.seed and config.finetune.seed are both unset; give one')
  if axis is None:
    return [config.finetune.seed]
  sweep.refuse_value_and_axis(config, {'seed': axis}, sets={'seed': SEEDED})
  return [finetune.TRAINING['seed'].check(s, 'config.sweep.seed') for s in axis]


def _seeded(config, seed: int) -> ml_collections.ConfigDict:
  """The config of one seed of config.sweep.seed: fine-tuning order, poisoned examples and
  merges drawn from it (without that axis, the config's own seeds)."""
  if not sweep.axes(config, 'seed'):
    return copy.deepcopy(config)
  return sweep.overridden(config, {key: seed for key in SEEDED})


def _poisoning(config, trigger_name: str | None, task: str) -> ml_collections.ConfigDict:
  """The config that fine-tunes `task` poisoned with `trigger_name`, or clean for None."""
  poisoned = copy.deepcopy(config)
  poisoned.poison.tasks = task if trigger_name else ''
  poisoned.poison.trigger = trigger_name or poisoned.poison.trigger
  return poisoned

