"""The checkpoint merge job: every check first, then the shards built in `<output>.partial/`
under a record of their plan, then the finished directory put in place.

Nothing is written before the plan, the inputs' names, shapes and dtypes and the output path
are checked. The output path is locked while the job writes it (`.<output>.lock` beside it,
which stays for the next job to lock). An existing
output is refused unless it is this job's own earlier output of the same plan and inputs (then
it is kept as it is) or `overwrite` is set. The partial directory records the plan, each
input's fingerprint (`editing.safetensors_io.fingerprint`) and the shard plan in
`merge_plan.json`; a rerun resumes its finished shards only when all of them match, and
otherwise refuses, naming the difference. The finished output keeps that record, so a rerun of
the same merge finds it done.

A fine-tuned model may be a PEFT LoRA adapter directory: it stands for the base with the
adapter merged in, and a LoRA-space method (KnOTS, PEFT's combinations) merges the adapters'
factors into an adapter instead (`adapters`).
"""

import json
import os
import shutil
import time
from typing import Sequence

import jax.numpy as jnp

from absl import logging

import merging
from editing import atomic
from editing import safetensors_io
from editing.errors import UserError
from editing.jobs import lock
from editing.models import hf
from editing.models import peft_adapter
from merging.checkpoints import adapters
from merging.checkpoints import extraction
from merging.checkpoints import passthrough
from merging.checkpoints import pipeline
from merging.checkpoints import plan as plan_lib
from merging.checkpoints import sliced
from merging.checkpoints import tensors as tensors_lib
from merging.jobs import mergekit

RECORD = 'merge_plan.json'
CARD = 'README.md'  # the model card
_COPIED = ('config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json',
           'special_tokens_map.json', 'tokenizer.model', 'vocab.txt', 'vocab.json', 'merges.txt')


def merge(base: str, models: Sequence[str], output: str, plan: plan_lib.Plan, *,
          overwrite: bool = False, recipe: str | None = None,
          slices: sliced.Slices | None = None) -> dict:
  """Merges `models` onto `base` into the Hugging Face directory `output`, whose README.md
  records the merge (and the mergekit `recipe`, its YAML text, if one set it); returns a
  summary. `slices` merge layer ranges of the models into the output's layers (`sliced`)."""
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
  _check_output_path(output, [base, *models])
  low_rank = plan.method not in plan_lib.SINGLE_MODEL and merging.get(plan.method).low_rank
  dense = [m for m in models if not peft_adapter.is_adapter(m)]
  if low_rank and dense:
    raise UserError(f'config.method = {plan.method} merges PEFT LoRA adapters, and {dense} '
                    f'hold no {peft_adapter.CONFIG}')
  base_ckpt = hf.Checkpoint(base)
  ckpts = [hf.Checkpoint(m) if m in dense else peft_adapter.Adapted(base_ckpt, m)
           for m in models]
  positions = None
  if slices is not None:
    if len(dense) < len(models) or plan.method in plan_lib.SINGLE_MODEL:
      raise UserError('config.slices: slices merge full checkpoints with a merging method; '
                      f'{plan.method} of {models} is not one')
    sliced.check(slices, [base, *models])
    viewed = sliced.views(slices, {base: base_ckpt, **dict(zip(models, ckpts))})
    base_ckpt, ckpts = viewed[base], [viewed[m] for m in models]
    positions = sliced.positions(slices, list(base_ckpt.files))
  names = sorted(base_ckpt.files)
  _check_same_tensors(base, base_ckpt, models, ckpts, names)
  shards = _shards(base_ckpt, names, plan)
  record = {'plan': plan.record(), 'inputs': [_fingerprint(c) for c in [base_ckpt, *ckpts]],
            'shards': [{'file': s.file, 'names': s.names} for s in shards]}
  if slices is not None:
    record['slices'] = [dict(piece) for piece in slices]
  partial = output + '.partial'
  summary = {'output': output, 'tensors': len(names), 'shards': len(shards),
             'bytes': sum(s.bytes for s in shards)}
  lock_file = os.path.join(os.path.dirname(output), f'.{os.path.basename(output)}.lock')
  with lock.held(lock_file, f'the merge output {output}'):
    if os.path.exists(output) and not overwrite:
      if _recorded(output) != record:
        raise UserError(f'config.output = {output} exists and is not this merge\'s output; '
                        'choose another path, or set config.overwrite=True to replace it')
      logging.info('%s already holds this merge', output)
      return {**summary, 'seconds': 0.0}
    _start_or_resume(partial, record)
    start = time.time()
    try:
      if plan.method == 'extract_lora':
        summary['extraction'] = extraction.write(base_ckpt, ckpts[0], partial, plan.settings,
                                                 base)
      elif low_rank:
        summary['adapter'] = adapters.write(base_ckpt, models, partial, plan, base)
      else:
        _write_shards(base_ckpt, ckpts, models, plan, partial, shards, len(names), positions)
    except UserError:
      # Bad input: no rerun under this plan and these inputs could finish the shards.
      shutil.rmtree(partial, ignore_errors=True)
      raise
    atomic.write_bytes(os.path.join(partial, CARD), _card(base, models, plan, recipe).encode())
    if plan.method == 'extract_lora' or low_rank:
      atomic.replace_directory(partial, output)  # an adapter: no index, no model config
    else:
      _finish(base, partial, output, shards, base_ckpt.config if slices else None)
  return {**summary, 'seconds': time.time() - start}


def _check_output_path(output: str, inputs: Sequence[str]) -> None:
  """Refuses an output that is a file, that is or lies inside an input, or that holds one."""
  if os.path.isfile(output):
    raise UserError(f'config.output = {output} is a file; give a directory path')
  for given in inputs:
    path = os.path.abspath(given)
    inside = os.path.commonpath([output, path])
    if inside in (output, path):
      raise UserError(f'config.output = {output} overlaps the input {given}; the output must '
                      'be a path of its own, outside every input')


def _check_same_tensors(base: str, base_ckpt: hf.Checkpoint, models: Sequence[str],
                        ckpts: Sequence[hf.Checkpoint], names: Sequence[str]) -> None:
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


def _fingerprint(ckpt: hf.Checkpoint) -> dict:
  files = sorted(set(ckpt.files.values()))
  return {'path': os.path.abspath(ckpt.path),
          'files': {os.path.abspath(f): safetensors_io.fingerprint(f) for f in files}}


def _recorded(directory: str) -> dict | None:
  path = os.path.join(directory, RECORD)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError:
      return None


def _start_or_resume(partial: str, record: dict) -> None:
  """Makes `partial` with its record, or checks that the one there was made for `record`."""
  if not os.path.exists(partial):
    os.makedirs(partial)
    atomic.write_json(os.path.join(partial, RECORD), record)
    return
  recorded = _recorded(partial)
  if recorded != record:
    raise UserError(f'{partial} holds part of another merge ({_difference(recorded, record)}); '
                    f'remove it to start over')
  logging.info('resuming the merge in %s', partial)


def _difference(recorded: dict | None, record: dict) -> str:
  """The first thing that differs between a recorded merge and this one, in words."""
  if recorded is None:
    return f'it has no readable {RECORD}'
  for key in sorted(set(recorded['plan']) | set(record['plan'])):
    if recorded['plan'].get(key) != record['plan'].get(key):
      return f'{key}: {recorded["plan"].get(key)!r} then, {record["plan"].get(key)!r} now'
  then = [i['path'] for i in recorded['inputs']]
  now = [i['path'] for i in record['inputs']]
  if then != now:
    return f'inputs: {then} then, {now} now'
  for old, new in zip(recorded['inputs'], record['inputs']):
    if old != new:
      return f'{new["path"]} has changed since'
  return 'its shard plan differs'


def _write_shards(base_ckpt, ckpts, models, plan, partial, shards, count, positions) -> None:
  """Each shard not yet in `partial`, a tensor at a time, with progress."""
  start, done_bytes, done_tensors = time.time(), 0, 0
  total_bytes = sum(s.bytes for s in shards)
  with pipeline.pool(len(ckpts)) as threads:
    tensors = tensors_lib.TensorMerge(base_ckpt, ckpts, models, plan, threads, positions)
    for shard in shards:
      path = os.path.join(partial, shard.file)
      if not os.path.exists(path):
        pipeline.write_streamed(path, shard.entries, tensors.prepare, tensors.block,
                                plan.prefetch)
      done_bytes += shard.bytes
      done_tensors += len(shard.entries)
      rate = done_bytes / max(time.time() - start, 1e-9)
      logging.info('%s: %d/%d tensors, %.0f tensors/s, %.1f MB/s, eta %.0f s', shard.file,
                   done_tensors, count, done_tensors / max(time.time() - start, 1e-9),
                   rate / 1e6, (total_bytes - done_bytes) / max(rate, 1e-9))


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


def _finish(base: str, partial: str, output: str, shards: list[safetensors_io.Shard],
            config: dict | None = None) -> None:
  """The index, the base's model config (or `config`, a sliced merge's) and tokenizer files,
  then `partial` put in place as `output`."""
  safetensors_io.write_index(partial, shards)
  if os.path.isdir(base):
    for name in _COPIED:
      if os.path.exists(os.path.join(base, name)):
        shutil.copy(os.path.join(base, name), os.path.join(partial, name))
  if config:
    atomic.write_json(os.path.join(partial, 'config.json'), config)
  atomic.replace_directory(partial, output)
  logging.info('merged checkpoint in %s', output)


def plan_of(config) -> plan_lib.Plan:
  """The plan configs/merge_checkpoints.py describes, every value checked."""
  section = config.get(config.method)
  try:
    weights = (tuple(float(w) for w in config.weights.split(',')) if config.weights.strip()
               else None)
  except ValueError:
    raise UserError(f'config.weights = {config.weights!r}: comma-separated numbers, one per '
                    'model') from None
  varying, per_model = (_json_object(config, key) for key in ('layered', 'per_model'))
  if not all(isinstance(v, list) for v in per_model.values()):
    raise UserError(f'config.per_model = {config.per_model!r}: a JSON object {{setting: '
                    '[one value per model]}')
  return plan_lib.Plan(config.method, section.to_dict() if section is not None else {},
                       scale=config.scale, seed=config.seed, shard_bytes=config.shard_bytes,
                       allow_nonfinite=config.allow_nonfinite, weights=weights,
                       dtype=config.dtype or None, prefetch=config.prefetch,
                       layered=tuple(sorted(varying.items())),
                       per_model=tuple((k, tuple(v)) for k, v in sorted(per_model.items())))


def _json_object(config, key: str) -> dict:
  text = config[key]
  try:
    value = json.loads(text) if text.strip() else {}
  except json.JSONDecodeError as e:
    raise UserError(f'config.{key} = {text!r} is not JSON ({e})') from None
  if not isinstance(value, dict):
    raise UserError(f'config.{key} = {text!r}: a JSON object {{field: value}}')
  return value


def run(config, workdir: str) -> dict:
  """The launch job: `config` as configs/merge_checkpoints.py describes it (or the mergekit
  YAML `config.mergekit` names); the output defaults to <workdir>/merged."""
  recipe = None
  if config.mergekit:
    config = mergekit.apply(config, config.mergekit)
    with open(config.mergekit) as f:
      recipe = f.read()
  output = config.output or os.path.join(workdir, 'merged')
  if config.method == 'passthrough':
    return _passthrough(config, output, recipe)
  plan = plan_of(config)
  if not config.base:
    raise UserError('config.base: give the base checkpoint (a Hugging Face directory or a '
                    '.safetensors file)')
  models = [m.strip() for m in config.models.split(',') if m.strip()]
  return merge(config.base, models, output, plan, overwrite=config.overwrite, recipe=recipe,
               slices=_slices(config))


def _slices(config) -> list | None:
  """config.slices: a JSON list of {model: [first layer, end layer]}, or None."""
  if not config.slices.strip():
    return None
  try:
    slices = json.loads(config.slices)
  except json.JSONDecodeError as e:
    raise UserError(f'config.slices = {config.slices!r} is not JSON ({e})') from None
  if not isinstance(slices, list) or not all(isinstance(s, dict) for s in slices):
    raise UserError(f'config.slices = {config.slices!r}: a JSON list of {{model: [first layer, '
                    'end layer]}, one object per slice')
  return slices


def _passthrough(config, output: str, recipe: str | None) -> dict:
  """config.passthrough's slices stacked into `output` (`passthrough.run`)."""
  section = config.passthrough
  try:
    slices = json.loads(section.slices or '[]')
    scale = json.loads(section.scale)
  except json.JSONDecodeError as e:
    raise UserError(f'config.passthrough: slices and scale are JSON ({e})') from None
  if not isinstance(slices, list) or not all(
      isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) for s in slices):
    raise UserError(f'config.passthrough.slices = {section.slices!r}: a JSON list of '
                    '[model, first layer, end layer]')
  return passthrough.run([passthrough.Slice(*s) for s in slices], output, scale=scale,
                         dtype=config.dtype or None, tokenizer=section.tokenizer or None,
                         shard_bytes=config.shard_bytes, overwrite=config.overwrite,
                         recipe=recipe)
