"""The one lifecycle of every checkpoint a job writes (a merge, a passthrough, an extracted
LoRA, a merged adapter): the output appears whole or not at all, a killed job resumes, and
nothing of the user's is overwritten or deleted unasked.

  1. The output path is checked against every input on real paths (symlinks resolved): an
     output that is, holds or lies inside an input is refused, `overwrite` or not. The job
     writes at the output's real path.
  2. The lock `.<output>.lock` beside it (`editing.lock`) is held to the end.
  3. An existing output is kept as it is when its record is this job's (the same job ran
     before), and otherwise refused unless `overwrite`.
  4. `<output>.partial/` holds the work under its record, RECORD. It is made if absent, and
     resumed if its record is this job's: the temporary files a killed write left in it are
     removed, and the data that its finished shards were made from is read again and checked
     unchanged (`digests`). A partial directory of another job is refused and kept; one with
     no record is not a job's at all, and is refused and kept too.
  5. The job fills it (`write`'s `fill`); then the copied files (config, tokenizer), the
     card and the record go in, and one atomic replace puts it at the output.

A bad input (a UserError while filling) removes the partial directory, since no rerun of the
same job could finish it; any other failure keeps it for the rerun to resume.
"""

import dataclasses
import errno
import json
import os
import shutil
from typing import Callable, Mapping, Sequence

from absl import logging

from editing import atomic
from editing import lock
from editing import safetensors_io
from editing.errors import UserError
from merging.checkpoints import digests

RECORD = 'merge_plan.json'
CARD = 'README.md'  # the model card
COPIED = ('config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json',
          'special_tokens_map.json', 'tokenizer.model', 'vocab.txt', 'vocab.json', 'merges.txt')
# The partial record's key for what its finished shards read: per reader, {tensor: digest}.
_READ = 'read'
_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclasses.dataclass(frozen=True)
class Target:
  """What a job writes, and from what."""

  output: str  # the directory to write, as the user gave it
  inputs: Sequence[str]  # every path the job reads; none may overlap the output
  record: dict  # what makes the output what it is: the plan, its inputs' fingerprints, shards
  readers: Sequence = ()  # checkpoints whose reads a resume checks (`digests`), in a fixed order
  card: str | None = None  # README.md
  copied_from: str | None = None  # a directory whose `copied` files, those it has, are copied
  copied: Sequence[str] = COPIED
  config: dict | None = None  # config.json, written over a copied one
  files: Mapping[str, dict] | None = None  # {name: JSON content}, written over copied ones


class Partial:
  """`<output>.partial/` while a job fills it: its `path`, the `readers` to read the inputs
  through (their reads hashed), and `shard_done`, called when a shard is in place."""

  def __init__(self, path: str, record: dict, readers: Sequence[digests.Watched]):
    self.path, self.readers, self._record = path, list(readers), record

  def has(self, name: str) -> bool:
    return os.path.exists(os.path.join(self.path, name))

  def shard_done(self) -> None:
    """Records what the finished shards read, for a resume to check."""
    atomic.write_json(os.path.join(self.path, RECORD),
                      {**self._record, _READ: [r.complete() for r in self.readers]})


def fingerprint(ckpt) -> dict:
  """What identifies a checkpoint's files for the record (`safetensors_io.fingerprint`)."""
  files = sorted(set(ckpt.files.values()))
  return {'path': os.path.abspath(ckpt.path),
          'files': {os.path.abspath(f): safetensors_io.fingerprint(f) for f in files}}


def checked_path(output: str, inputs: Sequence[str]) -> str:
  """The real path of `output`; refused when it is a file, or when it is, holds or lies
  inside an input, symlinks resolved on both sides."""
  real = os.path.realpath(output)
  if os.path.isfile(real):
    raise UserError(f'config.output = {output} is a file; give a directory path')
  for given in inputs:
    path = os.path.realpath(given)
    if os.path.commonpath([real, path]) in (real, path):
      via = '' if (real, path) == tuple(map(os.path.abspath, (output, given))) else (
          f' (real paths {real} and {path})')
      raise UserError(f'config.output = {output} overlaps the input {given}{via}; the output '
                      'must be a path of its own, outside every input')
  return real


def write(target: Target, fill: Callable[[Partial], None], *, overwrite: bool) -> bool:
  """Writes `target` through the lifecycle above, fill(partial) making the job's own files;
  False, with nothing written, when the output already holds this job's result."""
  output, given = checked_path(target.output, target.inputs), os.path.abspath(target.output)
  record = json.loads(json.dumps(target.record))  # as it reads back: lists, not tuples
  partial = output + '.partial'
  lock_file = os.path.join(os.path.dirname(output), f'.{os.path.basename(output)}.lock')
  with lock.held(lock_file, f'the merge output {given}'):
    if os.path.exists(output) and not overwrite:
      if _recorded(output) != record:
        raise UserError(f'config.output = {given} exists and is not this merge\'s output; '
                        'choose another path, or set config.overwrite=True to replace it')
      logging.info('%s already holds this merge', given)
      return False
    try:
      _produce(target, record, fill, partial, output)
    except OSError as e:
      raise _named(e, given, partial) from None
  return True


def _produce(target: Target, record: dict, fill: Callable[[Partial], None], partial: str,
             output: str) -> None:
  """Starts or resumes `partial`, fills it and puts it in place as `output`."""
  recorded = _start_or_resume(partial, record)
  readers = digests.watch(target.readers)
  for reader, read in zip(readers, recorded.get(_READ, [])):
    reader.check(read, partial)
  try:
    fill(Partial(partial, record, readers))
    _finish(target, record, partial, output)
  except UserError:
    # Bad input: no rerun of the same job on the same inputs could finish it.
    shutil.rmtree(partial, ignore_errors=True)
    raise


def _recorded(directory: str) -> dict | None:
  """The record in `directory` without what its shards read; None if it has none."""
  path = os.path.join(directory, RECORD)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    try:
      record = json.load(f)
    except json.JSONDecodeError:
      return None
  return {k: v for k, v in record.items() if k != _READ} if isinstance(record, dict) else None


def _start_or_resume(partial: str, record: dict) -> dict:
  """Makes `partial` with its record, or checks that the one there was made for `record` and
  removes the temporary files a killed write left in it; returns the full record there."""
  if not os.path.lexists(partial):
    os.makedirs(partial)
    atomic.write_json(os.path.join(partial, RECORD), record)
    return record
  recorded = _recorded(partial)
  if recorded is None:
    raise UserError(f'{partial} exists and has no readable {RECORD}: it is not a merge\'s, '
                    'and is left as it is; move it away, or choose another output path')
  if recorded != record:
    raise UserError(f'{partial} holds part of another merge ({_difference(recorded, record)}); '
                    'remove it to start over')
  _remove_temporaries(partial)
  logging.info('resuming the merge in %s', partial)
  with open(os.path.join(partial, RECORD)) as f:
    return json.load(f)


def _remove_temporaries(partial: str) -> None:
  """The files `editing.atomic` was writing in `partial` when the job was killed: never
  renamed into place, they are no part of the output."""
  for name in os.listdir(partial):
    path = os.path.join(partial, name)
    if name.startswith(atomic.TEMP_PREFIX) and os.path.isfile(path) and not os.path.islink(path):
      os.unlink(path)


def _difference(recorded: dict, record: dict) -> str:
  """The first thing that differs between a recorded job and this one, in words."""
  then_plan, now_plan = recorded.get('plan', {}), record.get('plan', {})
  for key in sorted(set(then_plan) | set(now_plan)):
    if then_plan.get(key) != now_plan.get(key):
      return f'{key}: {then_plan.get(key)!r} then, {now_plan.get(key)!r} now'
  then = [i['path'] for i in recorded.get('inputs', [])]
  now = [i['path'] for i in record.get('inputs', [])]
  if then != now:
    return f'inputs: {then} then, {now} now'
  for old, new in zip(recorded['inputs'], record['inputs']):
    if old != new:
      return f'{new["path"]} has changed since'
  return 'its shard plan differs'


def _finish(target: Target, record: dict, partial: str, output: str) -> None:
  """The copied files, config.json, the card and the record, then `partial` put in place."""
  source = target.copied_from
  if source is not None and os.path.isdir(source):
    for name in target.copied:
      if os.path.exists(os.path.join(source, name)):
        shutil.copy(os.path.join(source, name), os.path.join(partial, name))
  if target.config:
    atomic.write_json(os.path.join(partial, 'config.json'), target.config)
  for name, content in (target.files or {}).items():
    atomic.write_json(os.path.join(partial, name), content)
  if target.card is not None:
    atomic.write_bytes(os.path.join(partial, CARD), target.card.encode())
  atomic.write_json(os.path.join(partial, RECORD), record)
  atomic.replace_directory(partial, output)
  logging.info('wrote %s', output)


def _named(error: OSError, output: str, partial: str) -> Exception:
  """`error` naming where it happened: a full disk as one line that says what to do."""
  if error.errno in _FULL:
    return UserError(f'config.output = {output}: {error.strerror} while writing {partial}; '
                     'free space and run the same command again, which resumes from the '
                     'finished shards')
  if error.errno is not None and error.filename is None:
    return OSError(error.errno, error.strerror, partial)
  return error
