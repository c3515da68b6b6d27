"""The evaluation protocols over every configured regime's task vectors: single-task accuracy,
task addition, task negation and weight disentanglement (`editing.evaluate`), with their
reports."""

import os

import ml_collections
import numpy as np
from absl import logging

from editing import atomic
from editing import evaluate
from editing import linearity
from editing import settings
from editing import tree as tree_lib
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import experiment
from editing.jobs import report
from editing.jobs import workdir as workdir_lib

# config.eval: the protocols' grids, thresholds and sizes (`editing.evaluate`).
EVAL = dict(
    batch_size=settings.integer(512, '[1, inf)', 'images per evaluation batch'),
    alpha_step=settings.number(0.1, '(0, 1]', 'the step of α\'s grid 0, step, ..., 1'),
    negation_threshold=settings.number(0.95, '[0, 1]', 'the share of the pretrained control '
                                                       'accuracy negation must keep'),
    control_val_size=settings.integer(500, '[1, inf)', 'the control task\'s validation '
                                                       'examples, at most'),
    disentanglement_pairs=settings.text('', 'ξ\'s task pairs \'a:b,c:d\'; empty: consecutive '
                                            'pairs of the tasks'),
    disentanglement_limit=settings.number(2.0, '(0, inf)', 'ξ\'s grid spans ±limit'),
    disentanglement_points=settings.integer(9, '[1, inf)', 'ξ\'s grid points per axis'),
    disentanglement_size=settings.integer(128, '[1, inf)', 'test images per task ξ reads'),
    linearity_alphas=settings.text('0.5,1,2', 'the α of the linearity diagnostic, '
                                              'comma-separated; \'\': none'),
    linearity_size=settings.integer(64, '[1, inf)', 'test inputs of each other task that the '
                                                    'linearity diagnostic reads'))
SECTIONS = {'eval': EVAL}
# config.eval's keys that add a measurement beside the protocols and change none of their
# numbers (a merge's result does not depend on them).
BESIDE_THE_PROTOCOLS = ('linearity_alphas', 'linearity_size')


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs every protocol for every regime of `config.regimes`; writes <workdir>/results.json
  and report.md, and per regime evaluation/<regime>/."""
  checks.validate(config, SECTIONS)
  regimes = [r.name for r in experiment.configured_regimes(config)]
  pairs = disentanglement_pairs(config, experiment.tasks(config))
  linearity_alphas(config)
  exp = experiment.Experiment.load(config, workdir)
  for regime in regimes:
    exp.vectors(regime)
  # What the numbers depend on besides the vectors: a workdir evaluated under other data or
  # heads is refused, as fine-tuning refuses it.
  workdir_lib.check_job_config(
      workdir_lib.evaluation_root(workdir),
      {**experiment.data_settings(config, 'train_size', 'pretrain_size'),
       **experiment.head_settings(config), 'base': tree_lib.fingerprint(exp.theta0),
       **experiment.precision_settings(config)})
  workdir_lib.use_compilation_cache(workdir)
  control = experiment.control_task(config)
  if control in exp.tasks:
    raise UserError(f'the control task {control!r} is also one of the tasks '
                    f'({",".join(exp.tasks)}); negation needs a control that no task vector '
                    'was fine-tuned on')
  scored = exp.tasks + [control]
  pretrained = exp.evaluator('full').accuracies(
      exp.theta0, exp.theta0, {t: (exp.head(t), exp.task(t).test) for t in scored})
  results = {'tasks': exp.tasks, 'control_task': control, 'regimes': {}}
  for regime in regimes:
    results['regimes'][regime] = evaluate_regime(exp, regime, control, pretrained, pairs)
  atomic.write_json(os.path.join(workdir, 'results.json'), results)
  atomic.write_bytes(os.path.join(workdir, 'report.md'),
                     report.comparison_markdown(results).encode())
  print(report.comparison_table(results))
  return results


def _linearity(exp: experiment.Experiment, regime: str, vectors: dict, data: dict) -> dict:
  """`editing.linearity`'s departure d(α) of each task vector on the other tasks' test
  inputs, and its mean over the tasks; {} where config.eval.linearity_alphas is empty."""
  config, names = exp.config, exp.tasks
  alphas = linearity_alphas(config)
  if not alphas or len(names) < 2:
    return {}
  encoder = experiment.regime(config, regime).encoder(exp.apply_fn)
  size = config.eval.linearity_size
  inputs = {t: data[t].test.take(size).batch(np.arange(min(size, len(data[t].test))))[0]
            for t in names}
  departure = {}
  for t in names:
    logging.info('%s: linearity of %s on the other tasks\' inputs', regime, t)
    others = np.concatenate([inputs[o] for o in names if o != t])
    departure[t] = linearity.departures(encoder, exp.theta0, vectors[t], others, alphas)
  return {'alphas': alphas, 'departure': departure,
          'mean': np.mean(list(departure.values()), axis=0).tolist()}


def linearity_alphas(config: ml_collections.ConfigDict) -> list[float]:
  """config.eval.linearity_alphas as numbers, each > 0."""
  text = config.eval.linearity_alphas
  try:
    alphas = [float(a) for a in text.split(',') if a.strip()]
  except ValueError:
    alphas = None
  if alphas is None or not all(a > 0 for a in alphas):
    raise UserError(f'config.eval.linearity_alphas = {text!r}: numbers above 0, comma-separated')
  return alphas


def disentanglement_pairs(config: ml_collections.ConfigDict,
                          names: list[str]) -> list[tuple[str, str]]:
  """The task pairs of `config.eval.disentanglement_pairs`, or consecutive pairs of `names`."""
  spec = config.eval.disentanglement_pairs
  if not spec:
    return list(zip(names[0::2], names[1::2]))
  pairs = []
  for item in spec.split(','):
    pair = tuple(t.strip() for t in item.split(':'))
    if len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(names):
      raise UserError(f'config.eval.disentanglement_pairs: {item!r} is not two different '
                       f'configured tasks ({",".join(names)}) as "a:b"')
    pairs.append(pair)
  return pairs


def evaluate_regime(exp: experiment.Experiment, regime: str, control: str, pretrained: dict,
                    pairs: list[tuple[str, str]]) -> dict:
  """The protocols for one regime's task vectors, the task `control` held out of them; also
  written to evaluation/<regime>/."""
  config, theta0, names = exp.config, exp.theta0, exp.tasks
  vectors, evaluator = exp.vectors(regime), exp.evaluator(regime)
  data, heads = exp.data(names + [control]), exp.heads(names + [control])
  alphas = evaluate.alpha_grid(config.eval.alpha_step)

  logging.info('%s: single-task accuracies', regime)
  finetuned = evaluate.finetuned_accuracy(evaluator, theta0, list(vectors.values()), heads, data)

  logging.info('%s: task addition of %d task vectors over %d values of alpha', regime,
               len(names), len(alphas))
  addition = evaluate.task_addition(
      evaluator, theta0, sum(vectors.values()), heads={t: heads[t] for t in names},
      val={t: data[t].val for t in names}, test={t: data[t].test for t in names},
      finetuned=finetuned, alphas=alphas)

  negation = {}
  for t in names:
    logging.info('%s: task negation of %s', regime, t)
    negation[t] = evaluate.task_negation(
        evaluator, theta0, vectors[t], head=heads[t], val=data[t].val, test=data[t].test,
        control_head=heads[control],
        control_val=data[control].val.take(config.eval.control_val_size),
        control_test=data[control].test, alphas=alphas,
        threshold=config.eval.negation_threshold)

  grid = evaluate.disentanglement_grid(config.eval.disentanglement_limit,
                                       config.eval.disentanglement_points)
  size = config.eval.disentanglement_size
  xi = {}
  for a, b in pairs:
    logging.info('%s: weight disentanglement of %s and %s on a %dx%d grid', regime, a, b,
                 len(grid), len(grid))
    xi[f'{a}:{b}'] = evaluate.disentanglement(
        evaluator, theta0, (vectors[a], vectors[b]), heads=(heads[a], heads[b]),
        data=(data[a].test.take(size), data[b].test.take(size)), alphas=grid).tolist()

  linear = _linearity(exp, regime, vectors, data)

  results = {'regime': regime, 'tasks': names, 'control_task': control,
             'pretrained': pretrained, 'finetuned': finetuned, 'addition': addition,
             'negation': negation, 'negation_threshold': config.eval.negation_threshold,
             'disentanglement': {'alphas': grid, 'xi': xi,
                                 'mean': float(np.mean(list(xi.values()))) if xi else None},
             **({'linearity': linear} if linear else {})}
  directory = workdir_lib.evaluation_dir(exp.workdir, regime)
  atomic.write_json(os.path.join(directory, 'results.json'), results)
  atomic.write_bytes(os.path.join(directory, 'report.md'),
                     report.markdown(results).encode())
  report.plot_alpha_curves(results, os.path.join(directory, 'alpha_curves.png'))
  if xi:
    report.plot_disentanglement(results, os.path.join(directory, 'disentanglement.png'))
  print(report.table(results))
  logging.info('%s: mean single-task test accuracy: pretrained %.3f, fine-tuned %.3f', regime,
               np.mean([pretrained[t] for t in names]),
               np.mean([finetuned[t]['test'] for t in names]))
  return results
