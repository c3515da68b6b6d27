"""The merge sweep: every configured method over its hyperparameter grid, chosen on validation.

For every regime of `config.regimes` and method of `config.merge.methods`: merge with every
combination of the method's grid, choose the combination and λ (for the methods that scale
their merge) by mean normalized validation accuracy, report test accuracy there, and save the
merged params with orbax to <workdir>/merge/<regime>/<method>/params. Writes
<workdir>/merge/<regime>/results.json and report.md (methods sorted by mean normalized test
accuracy). With config.merge.continual, the continual protocol runs after the sweep
(merging/jobs/continual.py), and alone where config.merge.methods is empty. A method whose
result exists for the same settings is not rerun; under other
settings it is redone and overwritten. Results are kept per method: the report lists every
method whose stored result was made under the current settings, the ones listed in
`config.merge.methods` now and the ones merged before.

A method's section (config.<method>, or the section it shares) holds the values given to its
settings, each unset (None) until given; a setting left unset takes the default the method
declares (`editing.settings`: defaults, ranges, doc) where it is used. Its grid is written
apart (`editing.sweep`), in config.sweep.<section>: a tuple there is one axis of the grid
(`--config.sweep.ties.density='(0.1,0.2)'`). A setting is given a value or an axis, not both:
config.ties.density = 0.3 beside config.sweep.ties.density = (0.1, 0.2) is refused. Every value
is checked against the declaration before anything is written, and a result records the full
settings of the point chosen.
"""

import json
import os
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from editing import atomic
from editing import evaluate
from editing import settings as settings_lib
from editing import sweep
from editing import tree as tree_lib
from editing.errors import UserError
from editing.jobs import benchmark
from editing.jobs import checks
from editing.jobs import evaluate as evaluate_job
from editing.jobs import experiment
from editing.jobs import workdir as workdir_lib
from editing.progress import Progress
from editing.regimes.lora import LoRA
import merging
from merging import lines
from merging import wemoe
from merging.jobs import continual
from merging.jobs import inputs as inputs_lib
from merging.jobs import report

# config.merge: which methods, λ's grid, and what the data-driven methods read. (Each method's
# own settings are declared beside it, and checked by `hyperparameter_grid`.)
MERGE = dict(
    methods=settings_lib.text('task_arithmetic', 'the methods, comma-separated'),
    lambda_step=settings_lib.number(0.05, '(0, 1]', 'the step of λ\'s grid 0, step, ..., '
                                                    'lambda_max'),
    lines=settings_lib.text('', 'the methods also run scaled by depth (LiNeS), comma-separated'),
    seed=settings_lib.integer(0, '[0, inf)', 'the key of the methods that draw'),
    train_examples=settings_lib.integer(256, '[1, inf)', 'labeled training examples per task '
                                                         'that the data-driven methods read'),
    continual=settings_lib.text('', 'the continual merging methods run after the sweep, '
                                    'comma-separated (merging/continual.py); \'\': none'),
    orders=settings_lib.integer(3, '[1, inf)', 'task orders of the continual protocol'))
SECTIONS = {'merge': MERGE, **evaluate_job.SECTIONS}
# config.merge's keys that choose what runs beside a method's sweep, not how it merges: a
# result stays reusable whatever they are.
_BESIDE_THE_SWEEP = ('methods', 'lines', 'continual', 'orders')


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Merges and evaluates every method of `config.merge.methods` for every regime."""
  checks.validate(config, SECTIONS)
  continual_methods = continual.methods_from(config.merge.continual)
  methods = (methods_from(config.merge.methods, key='config.merge.methods')
             if config.merge.methods.strip() or not continual_methods else [])
  regimes = experiment.configured_regimes(config)
  for regime in regimes:
    refused = [m for m in methods if regime.name in merging.get(m).refused_regimes]
    if refused:
      raise UserError(f'config.merge.methods: {refused} cannot merge {regime.name} task '
                       'vectors; leave them out for that regime')
    low_rank = [m for m in methods if merging.get(m).low_rank]
    if low_rank and not isinstance(regime, LoRA):
      raise UserError(f'config.merge.methods: {low_rank} merge LoRA adapters, and the '
                      f'{regime.name} task vectors are dense; leave them out for that regime')
  count = len(experiment.tasks(config))
  fixed = [m for m in methods if merging.get(m).vectors not in (None, count)]
  if fixed:
    raise UserError(f'config.merge.methods: {fixed} merge '
                    f'{[merging.get(m).vectors for m in fixed]} task vectors, and the experiment '
                    f'has {count} tasks; leave them out')
  needing_trigger = [m for m in methods if 'trigger' in merging.get(m).reads]
  if needing_trigger:
    raise UserError(f'config.merge.methods: {needing_trigger} read the true backdoor trigger, '
                     'which only the safety experiment (launch.safety) has')
  perturbing = [m for m in methods if merging.get(m).perturbs_inputs]
  if perturbing and experiment.is_decoder(config):
    raise UserError(f'config.merge.methods: {perturbing} perturb the inputs in their own '
                    'space (a surrogate backdoor trigger on pixels), which tokens do not have; '
                    'leave them out for a decoder')
  for m in methods + lines_methods(config):
    hyperparameter_grid(config, m)
  exp = experiment.Experiment.load(config, workdir)
  for regime in regimes:
    exp.vectors(regime.name)
  workdir_lib.use_compilation_cache(workdir)
  results = {}
  for regime in regimes:
    results[regime.name] = merge_regime(exp, regime.name, methods) if methods else {}
    if continual_methods:
      results[regime.name]['continual'] = continual.run_regime(
          exp, regime.name, continual_methods, config.merge.orders, config.merge.seed)
  return results


def methods_from(value: str, *, key: str) -> list[str]:
  """The comma-separated merging methods of the config value at `key`, each registered."""
  return experiment.names_from(value, key=key, kind='method', known=list(merging.REGISTRY))


def hyperparameter_grid(config: ml_collections.ConfigDict, name: str) -> list[dict]:
  """Every point of method `name`'s sweep (config.sweep.<section>), each with every other
  setting at the value config.<section> gives it or else at its declared default; every value
  checked against the declaration, and a setting given both a value and an axis refused."""
  fixed = merging.check_settings(name, given(config, name), f'config.{_section(name)}')
  axes = _axes(config, name)
  return [{**fixed, **point} for point in sweep.points(axes)]


def given(config: ml_collections.ConfigDict, name: str) -> dict:
  """The settings of method `name` that config.<section> gives a value (None: not given)."""
  values = config.get(_section(name)) or {}
  return {k: v for k, v in values.items() if v is not None}


def swept(config: ml_collections.ConfigDict, name: str) -> list[str]:
  """The settings of method `name` that config.sweep gives a grid axis."""
  return sorted(_axes(config, name))


def _section(name: str) -> str:
  """The config section of method `name`'s settings."""
  return merging.get(name).section or name


def _axes(config: ml_collections.ConfigDict, name: str) -> dict[str, tuple]:
  """{setting: values} of method `name`'s axes in config.sweep.<section>, each value checked
  against the declaration; an axis over a setting that config.<section> also gives is
  refused."""
  section = _section(name)
  dotted = sweep.axes(config, section)
  declared = merging.get(name).settings
  axes = {}
  for key, axis in dotted.items():
    setting = key[len(section) + 1:]
    if setting not in declared:
      raise UserError(f'config.sweep.{key} is not a setting of {name}; its settings: '
                      f'{sorted(declared)}')
    axes[setting] = tuple(declared[setting].check(v, f'config.sweep.{key}') for v in axis)
  sweep.refuse_value_and_axis(config, dotted)
  return axes


def merge_regime(exp: experiment.Experiment, regime: str, methods: list[str]) -> dict:
  """The sweep of every method over one regime's task vectors; writes merge/<regime>/."""
  config, workdir, theta0, names = exp.config, exp.workdir, exp.theta0, exp.tasks
  vectors, evaluator = list(exp.vectors(regime).values()), exp.evaluator(regime)
  data, heads = exp.data(), exp.heads()
  finetuned = evaluate.finetuned_accuracy(evaluator, theta0, vectors, heads, data)
  pretrained = evaluator.accuracies(theta0, theta0, {t: (heads[t], data[t].test) for t in names})
  inputs = inputs_lib.MergeInputs(config, experiment.regime(config, regime).encoder(exp.apply_fn), theta0,
                       exp.apply_fn, heads, data)
  results = {}
  for name in methods + [m + LINES for m in lines_methods(config)]:
    directory = os.path.join(workdir_lib.merge_dir(workdir, regime), name)
    result_file = os.path.join(directory, 'result.json')
    if workdir_lib.reusable_result(directory, settings_used(config, name), result_file):
      with open(result_file) as f:
        results[name] = json.load(f)
      logging.info('%s/%s: result found in %s', regime, name, result_file)
      continue
    start = time.time()
    chosen = best_merge(config, name, vectors, inputs, evaluator, finetuned)
    _save_params(os.path.join(directory, 'params'), chosen.params)
    results[name] = {'method': name, **chosen.summary, 'seconds': time.time() - start}
    atomic.write_json(result_file, results[name])
  results.update(_earlier_results(config, workdir_lib.merge_dir(workdir, regime), results))
  summary = {'regime': regime, 'tasks': names, 'pretrained': pretrained,
             'finetuned': finetuned, 'methods': results}
  out = workdir_lib.merge_dir(workdir, regime)
  atomic.write_json(os.path.join(out, 'results.json'), summary)
  atomic.write_bytes(os.path.join(out, 'report.md'),
                     report.merging_markdown(summary).encode())
  print(report.merging_table(summary))
  return summary


def _earlier_results(config, directory: str, done: dict) -> dict:
  """{method: result} of the methods not in `done` merged earlier in `directory` under the
  settings the config now gives them."""
  earlier = {}
  for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
    result_file = os.path.join(directory, name, 'result.json')
    if name in done or _method(name) not in merging.REGISTRY or not os.path.exists(result_file):
      continue
    if workdir_lib.recorded_as(os.path.join(directory, name), settings_used(config, name)):
      with open(result_file) as f:
        earlier[name] = json.load(f)
  return earlier


def settings_used(config: ml_collections.ConfigDict, name: str) -> dict:
  """The config a merge's result depends on: its settings, its grid and the shared sections
  (not which other methods run beside it)."""
  method = _method(name)
  shared = {k: v for k, v in config.merge.to_dict().items() if k not in _BESIDE_THE_SWEEP}
  evaluation = {k: v for k, v in config.eval.to_dict().items()
                if k not in evaluate_job.BESIDE_THE_PROTOCOLS}
  axes = {k: list(v) for k, v in _axes(config, method).items()}
  fixed = merging.check_settings(method, given(config, method), f'config.{_section(method)}')
  return {'method': {k: v for k, v in fixed.items() if k not in axes},
          **({'sweep': axes} if axes else {}), **({'lines': True} if name != method else {}),
          'merge': shared,
          'eval': evaluation, **experiment.data_settings(config, 'train_size')}


class Chosen(NamedTuple):
  vector: Any  # the merged TaskVector ({task: its vector} for a per-task method; a model)
  params: Any  # θ0 + λ·τ_m at the chosen λ ({task: θ0 + τ'_t} for a per-task method; the
  # model's parts, for a method whose merge is a model)
  summary: dict  # hyperparameters, λ, validation score, test accuracies


def lines_methods(config: ml_collections.ConfigDict) -> list[str]:
  """The methods config.merge.lines also runs scaled by depth (LiNeS), each a result of its
  own, '<method>+lines'."""
  if not config.merge.get('lines', '').strip():
    return []
  scaled = [n for n, m in merging.REGISTRY.items() if m.scaled]
  return experiment.names_from(config.merge.lines, key='config.merge.lines', kind='scaled method',
                               known=scaled)


LINES = '+lines'


def _method(name: str) -> str:
  """The merging method of a result's name (a LiNeS result carries the suffix LINES)."""
  return name[:-len(LINES)] if name.endswith(LINES) else name


def best_merge(config: ml_collections.ConfigDict, name: str, vectors, inputs: inputs_lib.MergeInputs,
               evaluator: evaluate.Evaluator, finetuned: dict) -> Chosen:
  """Merges with every setting of the method's grid and keeps the one (and the λ) with the best
  mean normalized validation accuracy; test accuracy reported there.

  LoRA vectors are merged as their dense ΔW = s·B A, but by the LoRA-space methods.

  A LiNeS result ('<method>+lines') scales each merge by depth instead of by one λ: λ_ℓ =
  α + β·ℓ/(L − 1) with the authors' α for multi-task merging, and β on λ's grid in its place.
  """
  method_name = _method(name)
  method = merging.get(method_name)
  reads = inputs.read_by(method_name)
  if vectors[0].low_rank and not method.low_rank:
    logging.info('%s: merging the LoRA vectors\' ΔW = s·BA, multiplied out', name)
    vectors = [v.materialized(inputs.theta0) for v in vectors]
  names = list(inputs.data)
  if method.per_task:
    return _best_per_task(config, name, vectors, reads, inputs, evaluator, finetuned)
  if method.forward:
    return _best_model(config, name, vectors, reads, inputs, evaluator, finetuned)
  grid = (evaluate.alpha_grid(config.merge.lambda_step, method.lambda_max) if method.scaled
          else [1.0])
  best = None
  settings_grid = hyperparameter_grid(config, method_name)
  progress = Progress(f'{name} sweep', len(settings_grid), unit='settings')
  for settings in settings_grid:
    logging.info('%s: merging with %s', name, settings or 'defaults')
    vector = method.merge(vectors, **reads, **settings)
    # A NaN would survive even λ = 0 (0·NaN): refuse it before it is applied or saved.
    tree_lib.check_finite(vector.delta, f'the {name} merge with {settings or "defaults"}')
    if name == method_name:
      candidates = [(None, vector, grid)]
    else:
      # LiNeS scales leaves by their depth, and its α compares L1 norms of entries.
      dense = vector.materialized(inputs.theta0)
      alpha = lines.multi_task_alpha([v.materialized(inputs.theta0) for v in vectors], dense)
      candidates = [({'alpha': alpha, 'beta': beta}, lines.scale(dense, alpha, beta), [1.0])
                    for beta in grid]
    for depth_scaling, candidate, alphas in candidates:
      addition = evaluate.task_addition(
          evaluator, inputs.theta0, candidate, heads=inputs.heads,
          val={t: inputs.data[t].val for t in names},
          test={t: inputs.data[t].test for t in names}, finetuned=finetuned, alphas=alphas)
      score = max(p['normalized_val'] for p in addition['curve'])
      if best is None or score > best[0]:
        best = (score, settings, addition, candidate, depth_scaling)
    progress.advance()
  score, settings, addition, vector, depth_scaling = best
  logging.info('%s: mean test %.3f (normalized %.3f) with %s at lambda %s', name,
               addition['mean_test'], addition['mean_normalized_test'], settings,
               depth_scaling or addition['alpha'])
  summary = {'hyperparameters': settings, 'swept': swept(config, method_name),
             'lambda': addition['alpha'], 'normalized_val': score,
             **({'lines': depth_scaling} if depth_scaling else {}),
             **{k: addition[k] for k in ('test', 'normalized_test', 'mean_test',
                                         'mean_normalized_test')}}
  return Chosen(vector, vector.apply_to(inputs.theta0, addition['alpha']), summary)


def _best_per_task(config: ml_collections.ConfigDict, name: str, vectors, reads: dict,
                   inputs: inputs_lib.MergeInputs, evaluator: evaluate.Evaluator,
                   finetuned: dict) -> Chosen:
  """A method that keeps a vector per task, each task's model θ0 + τ'_t scored on its own
  data: each task's setting chosen on its own validation accuracy, as the TALL-mask paper
  chooses λ_t, and its test accuracy read there."""
  method, names, theta0 = merging.get(name), list(inputs.data), inputs.theta0
  score = lambda vector, t, split: evaluator.accuracies(
      theta0, evaluator.edit(theta0, vector, 1.0),
      {t: (inputs.heads[t], getattr(inputs.data[t], split))})[t]
  best = {}
  for settings in hyperparameter_grid(config, name):
    logging.info('%s: merging with %s', name, settings or 'defaults')
    for t, vector in zip(names, method.merge(vectors, **reads, **settings)):
      tree_lib.check_finite(vector.delta, f'the {name} merge of {t} with {settings or "defaults"}')
      accuracy = score(vector, t, 'val')
      if t not in best or accuracy > best[t][0]:
        best[t] = (accuracy, settings, vector)
  test = {t: score(best[t][2], t, 'test') for t in names}
  summary = {'hyperparameters': {t: best[t][1] for t in names}, 'swept': swept(config, name),
             'per_task': True, 'lambda': 1.0,
             'normalized_val': float(np.mean([best[t][0] / finetuned[t]['val'] for t in names])),
             **_test_summary(test, finetuned)}
  logging.info('%s: mean test %.3f (normalized %.3f), each task its own model', name,
               summary['mean_test'], summary['mean_normalized_test'])
  return Chosen({t: best[t][2] for t in names},
                {t: best[t][2].apply_to(theta0, 1.0) for t in names}, summary)


def _best_model(config: ml_collections.ConfigDict, name: str, vectors, reads: dict,
                inputs: inputs_lib.MergeInputs, evaluator: evaluate.Evaluator,
                finetuned: dict) -> Chosen:
  """A method whose merge is a model of its own (WEMoE), scored through its forward: the
  setting with the best mean normalized validation accuracy, test accuracy read there, the
  model's bytes beyond θ0 and its forward's FLOPs against one merged model's."""
  method, names, theta0 = merging.get(name), list(inputs.data), inputs.theta0
  scorer = evaluator.with_encoder(method.forward(evaluator.encoder))
  best = None
  for settings in hyperparameter_grid(config, name):
    logging.info('%s: merging with %s', name, settings or 'defaults')
    model = method.merge(vectors, **reads, **settings)
    tree_lib.check_finite(model, f'the {name} model with {settings or "defaults"}')
    val = scorer.accuracies(theta0, model, {t: (inputs.heads[t], inputs.data[t].val)
                                            for t in names})
    score = float(np.mean([val[t] / finetuned[t]['val'] for t in names]))
    if best is None or score > best[0]:
      best = (score, settings, model)
  score, settings, model = best
  test = scorer.accuracies(theta0, model, {t: (inputs.heads[t], inputs.data[t].test)
                                           for t in names})
  one_input = inputs.data[names[0]].test.batch(np.arange(1))[0]
  flops = lambda encoder, params: benchmark.step_flops(
      jax.jit(encoder).lower(theta0, params, one_input).compile(), 1)
  summary = {'hyperparameters': settings, 'swept': swept(config, name), 'lambda': 1.0,
             'normalized_val': score, **_test_summary(test, finetuned),
             'bytes_beyond_theta0': wemoe.stored_bytes(model, theta0),
             # XLA's count of the forward's FLOPs against one merged model's.
             'inference_flops': (flops(scorer.encoder, model)
                                 / flops(evaluator.encoder, theta0))}
  logging.info('%s: mean test %.3f (normalized %.3f), %d bytes beyond θ0, %.2f× the '
               'FLOPs of one model', name, summary['mean_test'],
               summary['mean_normalized_test'], summary['bytes_beyond_theta0'],
               summary['inference_flops'])
  return Chosen(model, model._asdict(), summary)


def _test_summary(test: dict, finetuned: dict) -> dict:
  """Test accuracies per task, normalized by the fine-tunes', and their means."""
  normalized = {t: test[t] / finetuned[t]['test'] for t in test}
  return {'test': test, 'normalized_test': normalized,
          'mean_test': float(np.mean(list(test.values()))),
          'mean_normalized_test': float(np.mean(list(normalized.values())))}


def _save_params(path: str, params) -> None:
  """The merged params as an orbax checkpoint (written to a temporary name, then renamed)."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(path), params, force=True)
