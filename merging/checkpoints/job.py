"""The checkpoint merge job: every check first, then the output written through the lifecycle
every checkpoint writer shares (`output`: overlap check, lock, `<output>.partial/` under its
record, resume, copied files, card, atomic replace).

Nothing is written before the plan, the inputs' names, shapes and dtypes and the output path
are checked. The record, `merge_plan.json`, holds the plan, each input's fingerprint
(`editing.safetensors_io.fingerprint`) and the shard plan; a rerun resumes the finished shards
only when all of them match and the data those shards were made from is unchanged, and
otherwise refuses, naming the difference. The finished output keeps that record, so a rerun of
the same merge finds it done.

A fine-tuned model may be a PEFT LoRA adapter directory: it stands for the base with the
adapter merged in, and a LoRA-space method (KnOTS, PEFT's combinations) merges the adapters'
factors into an adapter instead (`adapters`).
"""

import json
import os
import time
from typing import Sequence

import jax.numpy as jnp
import ml_collections

from absl import logging

import merging
from editing import safetensors_io
from editing import settings as settings_lib
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import evaluate_checkpoint
from editing.models import hf
from editing.models import peft_adapter
from merging import recipe as recipe_lib
from merging.checkpoints import adapters
from merging.checkpoints import calibrated
from merging.checkpoints import extraction
from merging.checkpoints import output as output_lib
from merging.checkpoints import passthrough
from merging.checkpoints import pipeline
from merging.checkpoints import plan as plan_lib
from merging.checkpoints import sliced
from merging.checkpoints import tensors as tensors_lib
from merging.checkpoints import upscaling
from merging.checkpoints import vocabulary
from merging.mergekit import moe

RECORD = output_lib.RECORD


def merge(base: str, models: Sequence[str], output: str, plan: plan_lib.Plan, *,
          overwrite: bool = False, recipe: str | None = None,
          slices: sliced.Slices | None = None, tokenizer: str | None = None,
          pad_to_multiple_of: int = 0,
          calibration: calibrated.Calibration | None = None) -> dict:
  """Merges `models` onto `base` into the Hugging Face directory `output`, whose README.md
  records the merge (and the mergekit `recipe`, its YAML text, if one set it); returns a
  summary. `slices` merge layer ranges of the models into the output's layers (`sliced`);
  `tokenizer` names the vocabulary the embedding rows are aligned to (`vocabulary`); the
  data-driven merges of decoders read their Grams on the `calibration` windows
  (`calibrated`)."""
  if not models:
    raise UserError('config.models: no fine-tuned model to merge')
  count = 1 if plan.method in plan_lib.SINGLE_MODEL else merging.get(plan.method).vectors
  if count is not None and len(models) != count:
    raise UserError(f'config.models: {plan.method} takes exactly {count} fine-tuned '
                    f'model{"s" if count > 1 else ""}, got {len(models)}')
  if plan.weights is not None and len(plan.weights) != len(models):
    raise UserError(f'config.weights: {len(plan.weights)} weights for {len(models)} fine-tuned '
                    'models; give one per model, in order')
  output = os.path.abspath(output)
  output_lib.checked_path(output, [base, *models])
  low_rank = plan.method not in plan_lib.SINGLE_MODEL and merging.get(plan.method).low_rank
  dense = [m for m in models if not peft_adapter.is_adapter(m)]
  if low_rank and dense:
    raise UserError(f'config.method = {plan.method} merges PEFT LoRA adapters, and {dense} '
                    f'hold no {peft_adapter.CONFIG}')
  base_ckpt = hf.Checkpoint(base)
  ckpts = [hf.Checkpoint(m) if m in dense else peft_adapter.Adapted(base_ckpt, m)
           for m in models]
  if plan.method in calibrated.METHODS and calibration is None:
    raise UserError(f'config.method = {plan.method} takes its Grams on calibration text; give '
                    'config.calibration.file')
  if calibration is not None and plan.method not in calibrated.METHODS:
    raise UserError(f'config.calibration.file is read by the data-driven merges of decoders, '
                    f'{", ".join(calibrated.METHODS)}; config.method = {plan.method} reads none')
  if calibration is not None:
    if slices is not None or tokenizer is not None or pad_to_multiple_of:
      raise UserError(f'config.method = {plan.method}: a data-driven merge runs the models '
                      'whole, not with config.slices or config.tokenizer')
    calibrated.LayerMerge.check(base_ckpt)
  positions = None
  if slices is not None:
    if len(dense) < len(models) or plan.method in plan_lib.SINGLE_MODEL:
      raise UserError('config.slices: slices merge full checkpoints with a merging method; '
                      f'{plan.method} of {models} is not one')
    sliced.check(slices, [base, *models])
    viewed = sliced.views(slices, {base: base_ckpt, **dict(zip(models, ckpts))})
    base_ckpt, ckpts = viewed[base], [viewed[m] for m in models]
    positions = sliced.positions(slices, list(base_ckpt.files))
  aligned = None
  if tokenizer is not None or pad_to_multiple_of:
    if len(dense) < len(models) or slices is not None:
      raise UserError(f'config.tokenizer = {tokenizer}: the rows are aligned for merges of '
                      'whole checkpoints, not of adapters or slices')
    if vocabulary.EMBEDDINGS[0] not in base_ckpt.files:
      raise UserError(f'config.tokenizer = {tokenizer}: {base} has no '
                      f'{vocabulary.EMBEDDINGS[0]} to align')
    rows = [c.header(vocabulary.EMBEDDINGS[0])[0][0] for c in [base_ckpt, *ckpts]]
    aligned = vocabulary.Aligned(
        vocabulary.build(tokenizer or 'base', base, models, rows, pad_to_multiple_of),
        [base_ckpt, *ckpts])
    base_ckpt, *ckpts = [vocabulary.View(c, aligned, i) for i, c in enumerate([base_ckpt, *ckpts])]
  else:
    vocabulary.check_same(base, dense)
  names = sorted(base_ckpt.files)
  _check_same_tensors(base, base_ckpt, models, ckpts, names)
  if calibration is not None:
    names = calibrated.LayerMerge.order_of(base_ckpt)
  shards = _shards(base_ckpt, names, plan)
  record = {'plan': plan.record(),
            'inputs': [output_lib.fingerprint(c) for c in [base_ckpt, *ckpts]],
            'shards': [{'file': s.file, 'names': s.names} for s in shards]}
  if slices is not None:
    record['slices'] = [dict(piece) for piece in slices]
  if calibration is not None:
    record['calibration'] = calibrated.digest(calibration)
  if aligned is not None:
    record['vocabulary'] = {'tokenizer': tokenizer, 'pad_to_multiple_of': pad_to_multiple_of,
                            'rows': aligned.vocabulary.rows}
  summary = {'output': output, 'tensors': len(names), 'shards': len(shards),
             'bytes': sum(s.bytes for s in shards)}
  adapter = plan.method == 'extract_lora' or low_rank  # an adapter: no index, no model config

  def fill(partial: output_lib.Partial) -> None:
    if plan.method == 'extract_lora':
      summary['extraction'] = extraction.write(base_ckpt, ckpts[0], partial.path,
                                               plan.settings, base)
    elif low_rank:
      summary['adapter'] = adapters.write(base_ckpt, models, partial.path, plan, base)
    elif calibration is not None:
      _write_calibrated(partial, plan, shards, calibration)
    else:
      summary['phase_seconds'] = _write_shards(partial, models, plan, shards, len(names),
                                               positions)

  target = output_lib.Target(
      output, [base, *models], record, readers=() if adapter else [base_ckpt, *ckpts],
      card=_card(base, models, plan, recipe), copied_from=None if adapter else base,
      config=base_ckpt.config if slices or aligned else None,
      files=aligned.vocabulary.files() if aligned else None)
  start = time.time()
  if not output_lib.write(target, fill, overwrite=overwrite):
    return {**summary, 'seconds': 0.0}
  return {**summary, 'seconds': time.time() - start}


def _check_same_tensors(base: str, base_ckpt: hf.Checkpoint, models: Sequence[str],
                        ckpts: Sequence[hf.Reader], names: Sequence[str]) -> None:
  """Every fine-tuned model has the base's tensors, of the same shapes and dtypes."""
  for path, ckpt in zip(models, ckpts):
    missing = sorted(set(names) - set(ckpt.files))
    extra = sorted(set(ckpt.files) - set(names))
    if missing or extra:
      raise UserError(f'{path} does not have the tensors of {base}: missing {missing[:5]}'
                      f'{"..." if len(missing) > 5 else ""}, extra {extra[:5]}'
                      f'{"..." if len(extra) > 5 else ""}')
    for name in names:
      ours, theirs = base_ckpt.header(name), ckpt.header(name)
      if ours != theirs:
        raise UserError(f'{path}: {name} is {theirs[1]}{list(theirs[0])}, the base '
                        f'{ours[1]}{list(ours[0])}')


def _write_shards(partial: output_lib.Partial, models, plan, shards, count,
                  positions) -> dict[str, float]:
  """Each shard not yet in `partial`, a tensor at a time, with progress; then the index.
  Returns the seconds spent in each phase (`pipeline.Phases`: prepare, read, to_device,
  compute, from_device, write), summed over threads."""
  start, done_bytes, done_tensors = time.time(), 0, 0
  total_bytes = sum(s.bytes for s in shards)
  base_ckpt, *ckpts = partial.readers
  with pipeline.pool(len(ckpts)) as threads:
    tensors = tensors_lib.TensorMerge(base_ckpt, ckpts, models, plan, threads, positions)
    for shard in shards:
      if not partial.has(shard.file):
        pipeline.write_streamed(os.path.join(partial.path, shard.file), shard.entries,
                                tensors.prepare, tensors.block, plan.prefetch, tensors.spans,
                                tensors.phases)
        partial.shard_done()
      done_bytes += shard.bytes
      done_tensors += len(shard.entries)
      rate = done_bytes / max(time.time() - start, 1e-9)
      logging.info('%s: %d/%d tensors, %.0f tensors/s, %.1f MB/s, eta %.0f s', shard.file,
                   done_tensors, count, done_tensors / max(time.time() - start, 1e-9),
                   rate / 1e6, (total_bytes - done_bytes) / max(rate, 1e-9))
  safetensors_io.write_index(partial.path, shards)
  return {phase: round(seconds, 3) for phase, seconds in tensors.phases.seconds.items()}


def _write_calibrated(partial: output_lib.Partial, plan: plan_lib.Plan, shards,
                      calibration: calibrated.Calibration) -> None:
  """The shards of a data-driven merge, its tensors made a layer at a time in the order the
  shards hold them (a resumed merge runs every layer again, for the streams, and keeps only
  the tensors of the shards not yet written)."""
  base_ckpt, *ckpts = partial.readers
  wanted = {name for shard in shards if not partial.has(shard.file) for name in shard.names}
  layers = calibrated.LayerMerge(base_ckpt, ckpts, plan.method, plan.settings, plan.scale,
                                 calibration, wanted)
  dtypes = {name: dtype for shard in shards for name, _, dtype in shard.entries}
  pipeline.write_shards(partial, shards,
                        lambda name: layers.tensor(name).astype(dtypes[name]).reshape(-1),
                        lambda whole, first, end: whole[first:end], plan.prefetch)


def _card(base: str, models: Sequence[str], plan: plan_lib.Plan, recipe: str | None) -> str:
  """The output's model card: what was merged, and how, in Markdown."""
  lines = ['# Merged model', '',
           'Merged with `python -m launch.merge_checkpoints` (editmerge).', '',
           f'- method: `{plan.method}`', f'- settings: `{json.dumps(plan.settings)}`',
           f'- scale λ: {plan.scale}', f'- base: `{base}`', '- models:']
  weights = plan.weights or [None] * len(models)
  lines += [f'  - `{m}`' + ('' if w is None else f' (weight {w})') for m, w in zip(models, weights)]
  lines += ['', f'Every setting, the seed and each input\'s fingerprint are in {RECORD}.']
  if recipe is not None:
    lines += ['', '## Recipe (mergekit YAML)', '', '```yaml', recipe.rstrip('\n'), '```']
  return '\n'.join(lines) + '\n'


def _shards(base: hf.Checkpoint, names: list[str],
            plan: plan_lib.Plan) -> list[safetensors_io.Shard]:
  """The output's shards: its tensors in sorted order, each floating one in the plan's dtype."""
  entries = []
  for name in names:
    shape, dtype = base.header(name)
    entries.append((name, shape, plan.output_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating)
                    else dtype))
  return safetensors_io.plan_shards(entries, plan.shard_bytes)


def plan_of(config) -> plan_lib.Plan:
  """The plan configs/merge_checkpoints.py's flags describe, every value checked."""
  return recipe_lib.Recipe.from_flags(config).plan()


def run(config, workdir: str) -> dict:
  """The launch job: the merge `config`'s flags describe (or the mergekit YAML
  `config.mergekit` names), as a `merging.recipe.Recipe`, or the MoE upscaling of the
  mergekit-moe YAML `config.mergekit_moe` (`upscaling`); the output defaults to
  <workdir>/merged. Where config.evaluate names a file to score, the output and its inputs
  are then scored side by side (`editing.jobs.evaluate_checkpoint`: <workdir>/
  checkpoint_scores.json and .md), the files read and checked before the merge."""
  evaluation = _evaluation(config)
  if config.mergekit_moe:
    if config.mergekit:
      raise UserError('config.mergekit and config.mergekit_moe are both set; give one recipe')
    moe_recipe = moe.read(config.mergekit_moe)
    inputs = [moe_recipe.base_model, *(e.source_model for e in moe_recipe.experts)]
    summary = upscaling.run(moe_recipe, config.output or os.path.join(workdir, 'merged'),
                            overwrite=config.overwrite, seed=config.seed,
                            shard_bytes=config.shard_bytes)
  else:
    if config.mergekit:
      recipe = recipe_lib.Recipe.from_mergekit(config.mergekit, config)
    else:
      recipe = recipe_lib.Recipe.from_flags(config)
    output = recipe.output or os.path.join(workdir, 'merged')
    if recipe.method == recipe_lib.PASSTHROUGH:
      inputs = [model for piece in recipe.slices for model in piece]
      summary = _passthrough(recipe, output)
    else:
      inputs = [recipe.base, *recipe.models]
      summary = merge(recipe.base, list(recipe.models), output, recipe.plan(),
                      overwrite=recipe.overwrite, recipe=recipe.mergekit_yaml,
                      slices=recipe.slices, tokenizer=recipe.tokenizer,
                      pad_to_multiple_of=recipe.pad_to_multiple_of,
                      calibration=_calibration(config, recipe))
  if evaluation is not None:
    evaluation.checkpoints = ','.join(dict.fromkeys([*inputs, summary['output']]))
    summary['scores'] = evaluate_checkpoint.run(evaluation, workdir)
  return summary


def _calibration(config, recipe: 'recipe_lib.Recipe') -> calibrated.Calibration | None:
  """config.calibration's windows, read by the base's tokenizer, where its file is given."""
  section = config.get('calibration')
  if section is None or not section.get('file'):
    return None
  values = settings_lib.check(calibrated.SETTINGS, section.to_dict(), 'config.calibration')
  return calibrated.read(values, recipe.base)


def _evaluation(config) -> ml_collections.ConfigDict | None:
  """The scoring config.evaluate asks for, its files read and checked; None if it names none."""
  sections = config.get('evaluate')
  if sections is None or not any(sections[name].get('file') for name in sections):
    return None
  evaluation = ml_collections.ConfigDict({'checkpoints': '', **sections.to_dict()})
  checks.validate(evaluation, evaluate_checkpoint.SECTIONS)
  evaluate_checkpoint.read_inputs(evaluation)
  return evaluation


def _passthrough(recipe: 'recipe_lib.Recipe', output: str) -> dict:
  """The recipe's slices, one model each, stacked into `output` (`passthrough.run`)."""
  slices = []
  for k, piece in enumerate(recipe.slices):
    if len(piece) != 1 or not sliced.is_layer_range(next(iter(piece.values()))):
      raise UserError(f'config.slices[{k}] = {piece!r}: passthrough takes one model a slice, '
                      '{model: [first layer, end layer]}')
    (model, (first, end)), = piece.items()
    slices.append(passthrough.Slice(model, first, end))
  return passthrough.run(slices, output, scale=recipe.layered.get('scale', recipe.scale),
                         dtype=recipe.dtype, tokenizer=recipe.tokenizer,
                         shard_bytes=recipe.shard_bytes, overwrite=recipe.overwrite,
                         recipe=recipe.mergekit_yaml)
