"""Scores decoder checkpoints side by side: perplexity over a text file, multiple-choice
accuracy and exact match of greedy answers, each optional (`editing.scoring`).

A checkpoint is a Hugging Face directory (config.json, safetensors, and tokenizer.json with
tokenizer_config.json for its special tokens) or a .gguf file (its tokenizer in its metadata);
each is scored with its own tokenizer. Every text is encoded without the tokenizer's special
tokens and preceded by one prefix token, BOS (or EOS where the model has no BOS), as
`scoring.file_perplexity` starts its documents, so a prompt is never empty.

  perplexity        config.perplexity.file: .txt, .jsonl or .parquet (`scoring.read_documents`),
                    in windows of config.perplexity.window tokens every .stride tokens
  multiple choice   config.multiple_choice.file: a .jsonl of questions in lm-eval-harness's
                    shapes (`read_questions`); acc and acc_norm as the harness counts them
  exact match       config.exact_match.file: a .jsonl of {"prompt", "answer"}; each answer
                    generated greedily, stopped at EOS, stripped, equal to the reference

Every input is read and checked before any model is loaded, and the results are written
only once every checkpoint is scored, so a bad input stops the job with one line and nothing
written. Writes <workdir>/checkpoint_scores.json (per checkpoint, the metrics and each
question's and prompt's details) and checkpoint_scores.md (one row per checkpoint, one column
per metric), and prints the table.
"""

import os
from typing import Any, NamedTuple

import ml_collections
import numpy as np
from absl import logging

from editing import atomic
from editing import scoring
from editing import settings as settings_lib
from editing.errors import UserError
from editing.jobs import checks
from editing.models import gguf
from editing.models.tokenizer import Tokenizer
from third_party import hf_decoder

PERPLEXITY = dict(
    file=settings_lib.text('', 'the text to score (.txt, .jsonl, .parquet); \'\': none'),
    field=settings_lib.text('text', 'the field of a .jsonl line or the column of a .parquet '
                                    'file that holds the text'),
    window=settings_lib.integer(1024, '[2, inf)', 'tokens a window reads'),
    stride=settings_lib.integer(512, '[1, inf)', 'tokens between window starts, below window'))
MULTIPLE_CHOICE = dict(
    file=settings_lib.text('', 'a .jsonl of questions with choices and the gold index; '
                               '\'\': none'),
    delimiter=settings_lib.text(' ', 'between the question and each choice (lm-eval-harness\'s '
                                     'target_delimiter)'))
EXACT_MATCH = dict(
    file=settings_lib.text('', 'a .jsonl of {"prompt", "answer"}; \'\': none'),
    max_new_tokens=settings_lib.integer(32, '[1, inf)', 'tokens generated per prompt at most'))
SCORING = dict(
    batch_size=settings_lib.integer(8, '[1, inf)', 'rows of a forward pass'))
SECTIONS = {'perplexity': PERPLEXITY, 'multiple_choice': MULTIPLE_CHOICE,
            'exact_match': EXACT_MATCH, 'scoring': SCORING}

# The keys a multiple-choice line is read from, each the first of its list that the line has.
QUESTION_KEYS = ('query', 'question', 'context')
CHOICES_KEY = 'choices'
GOLD_KEYS = ('gold', 'label', 'answer')
RESULTS, TABLE = 'checkpoint_scores.json', 'checkpoint_scores.md'


class Question(NamedTuple):
  text: str
  choices: list[str]
  gold: int


class Inputs(NamedTuple):
  """Every input file read and checked; None for an evaluation not asked for."""
  documents: list[str] | None
  questions: list[Question] | None
  pairs: list[tuple[str, str]] | None


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Scores every checkpoint of config.checkpoints; writes and prints the results."""
  checks.validate(config, SECTIONS)
  paths = checkpoint_paths(config.checkpoints)
  inputs = read_inputs(config)
  for path in paths:  # a checkpoint without a tokenizer is refused before any is loaded
    _tokenizer(path)
  results = {}
  for path in paths:
    logging.info('scoring %s', path)
    results[path] = score(path, config, inputs)
  table = markdown_table(results)
  atomic.write_json(os.path.join(workdir, RESULTS), {
      'checkpoints': results,
      'settings': {name: config[name].to_dict() for name in SECTIONS}})
  atomic.write_bytes(os.path.join(workdir, TABLE), (table + '\n').encode())
  print(table)
  return results


def checkpoint_paths(checkpoints: str) -> list[str]:
  """The comma-separated checkpoints, each an existing directory or .gguf file, none twice."""
  paths = [p.strip() for p in checkpoints.split(',') if p.strip()]
  if not paths:
    raise UserError('config.checkpoints is empty: name the checkpoints to score, '
                    'comma-separated')
  for path in paths:
    if not os.path.exists(path):
      raise UserError(f'config.checkpoints: {path} does not exist')
    if not os.path.isdir(path) and not path.lower().endswith('.gguf'):
      raise UserError(f'config.checkpoints: {path} is neither a Hugging Face directory nor a '
                      '.gguf file')
  repeated = sorted({p for p in paths if paths.count(p) > 1})
  if repeated:
    raise UserError(f'config.checkpoints names {repeated[0]} twice')
  return paths


def read_inputs(config: ml_collections.ConfigDict) -> Inputs:
  """The texts, questions and (prompt, answer) pairs of the evaluations asked for."""
  ppl, mc, em = config.perplexity, config.multiple_choice, config.exact_match
  if not (ppl.file or mc.file or em.file):
    raise UserError('nothing to score: set config.perplexity.file, config.multiple_choice.file '
                    'or config.exact_match.file')
  if ppl.file and ppl.stride >= ppl.window:
    raise UserError(f'config.perplexity.stride = {ppl.stride} must be below '
                    f'config.perplexity.window = {ppl.window}')
  return Inputs(scoring.read_documents(ppl.file, ppl.field) if ppl.file else None,
                read_questions(mc.file) if mc.file else None,
                read_pairs(em.file) if em.file else None)


def _records(path: str, what: str) -> list[tuple[int, dict]]:
  """(line number, object) of each non-blank line of the .jsonl file `path`."""
  if not path.lower().endswith('.jsonl'):
    raise UserError(f'{path}: {what} are read from a .jsonl file')
  if not os.path.isfile(path):
    raise UserError(f'{path} does not exist')
  records = scoring.jsonl_objects(path)
  if not records:
    raise UserError(f'{path} holds no {what}')
  return records


def _first_key(record: dict, keys: tuple[str, ...], where: str) -> Any:
  for key in keys:
    if key in record:
      return record[key]
  raise UserError(f'{where}: none of the keys {list(keys)}')


def read_questions(path: str) -> list[Question]:
  """The multiple-choice questions of a .jsonl file in lm-eval-harness's shapes, one a line:

    the question   the first of "query", "question", "context": a string;
    "choices"      a list of strings, or ARC's {"text": [strings], "label": [names]};
    the gold       the first of "gold", "label", "answer": the index of the right choice
                   (an integer, or a string of digits), or, with ARC's choices, its label.
  """
  return [_question(record, f'{path}, line {number}')
          for number, record in _records(path, 'questions')]


def _question(record: dict, where: str) -> Question:
  text = _first_key(record, QUESTION_KEYS, where)
  if not isinstance(text, str):
    raise UserError(f'{where}: the question is a {type(text).__name__}, not text')
  choices, labels = _first_key(record, (CHOICES_KEY,), where), None
  if isinstance(choices, dict) and 'text' in choices and 'label' in choices:
    choices, labels = choices['text'], choices['label']
    if not isinstance(labels, list) or len(labels) != len(choices):
      raise UserError(f'{where}: choices.label does not name each of choices.text')
  if (not isinstance(choices, list) or not choices or
      not all(isinstance(c, str) and c for c in choices)):
    raise UserError(f'{where}: "choices" must be a non-empty list of non-empty strings')
  gold = _first_key(record, GOLD_KEYS, where)
  if labels is not None and gold in labels:
    gold = labels.index(gold)
  elif isinstance(gold, str) and gold.isdigit():
    gold = int(gold)
  if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
    raise UserError(f'{where}: the gold {gold!r} is not the index of one of its '
                    f'{len(choices)} choices')
  return Question(text, choices, gold)


def read_pairs(path: str) -> list[tuple[str, str]]:
  """The (prompt, answer) pairs of a .jsonl file of {"prompt": string, "answer": string}."""
  pairs = []
  for number, record in _records(path, 'prompts'):
    for key in ('prompt', 'answer'):
      if not isinstance(record.get(key), str):
        raise UserError(f'{path}, line {number}: no string "{key}"')
    pairs.append((record['prompt'], record['answer']))
  return pairs


def _tokenizer(path: str) -> Tokenizer:
  """The checkpoint's own tokenizer: its tokenizer.json, or its GGUF metadata's."""
  if os.path.isdir(path):
    return Tokenizer.from_directory(path)
  return gguf.File(path).tokenizer


def score(path: str, config: ml_collections.ConfigDict, inputs: Inputs) -> dict:
  """The metrics of one checkpoint on the inputs asked for."""
  if os.path.isdir(path):
    model, params = hf_decoder.load(path)
    tokenizer = Tokenizer.from_directory(path)
  else:
    model, params, tokenizer = gguf.load_gguf(path)
  batch_size = config.scoring.batch_size
  result = {}
  if inputs.documents is not None:
    ppl = config.perplexity
    measured = scoring.file_perplexity(model, params, tokenizer, ppl.file, window=ppl.window,
                                       stride=ppl.stride, field=ppl.field,
                                       batch_size=batch_size)
    result['perplexity'] = measured._asdict()
  if inputs.questions is not None:
    result['multiple_choice'] = _multiple_choice(
        model, params, tokenizer, path, inputs.questions, config.multiple_choice.delimiter,
        batch_size)
  if inputs.pairs is not None:
    result['exact_match'] = _exact_match(model, params, tokenizer, path, inputs.pairs,
                                         config.exact_match.max_new_tokens)
  return result


def choice_tokens(tokenizer: Tokenizer, prefix: int, context: str,
                  continuation: str) -> tuple[list[int], list[int]]:
  """(prompt, continuation) token ids as lm-eval-harness splits a pair: the whole text is
  encoded at once and the continuation is what follows the context's own tokens, so a token
  that spans the boundary is scored with the continuation; whitespace that ends the context is
  moved to the continuation, as the harness moves it."""
  stripped = context.rstrip()
  continuation = context[len(stripped):] + continuation
  context_ids = tokenizer.encode(stripped, add_special_tokens=False)
  whole = tokenizer.encode(stripped + continuation, add_special_tokens=False)
  return [prefix] + context_ids, whole[len(context_ids):]


def _multiple_choice(model, params, tokenizer, path, questions, delimiter, batch_size) -> dict:
  """acc and acc_norm over the questions, with each choice's summed log-likelihood."""
  prefix = tokenizer.prefix_id()
  batch = []
  for number, q in enumerate(questions, 1):
    pairs = [choice_tokens(tokenizer, prefix, q.text, delimiter + c) for c in q.choices]
    if not all(continuation for _, continuation in pairs):
      raise UserError(f'{path}: a choice of question {number} encodes to no tokens')
    # A choice's length for acc_norm is its own text, as the harness counts it.
    batch.append((pairs[0][0], [c for _, c in pairs], q.choices))
  chosen = scoring.multiple_choice_batch(model, params, batch, batch_size=batch_size)
  return {
      'acc': float(np.mean([c.acc == q.gold for c, q in zip(chosen, questions)])),
      'acc_norm': float(np.mean([c.acc_norm == q.gold for c, q in zip(chosen, questions)])),
      'questions': len(questions),
      'log_likelihoods': [c.log_likelihoods.tolist() for c in chosen]}


def _exact_match(model, params, tokenizer, path, pairs, max_new_tokens) -> dict:
  """The share of prompts whose greedy answer, stopped at EOS, equals the reference."""
  prefix = tokenizer.prefix_id()
  eos = tokenizer.token_id('eos_token')
  pad = tokenizer.token_id('pad_token')
  prompts = [[prefix] + tokenizer.encode(p, add_special_tokens=False) for p, _ in pairs]
  share, predictions = scoring.exact_match(
      model, params, prompts, [a for _, a in pairs], tokenizer.decode,
      max_new_tokens=max_new_tokens, eos_ids=() if eos is None else (eos,),
      pad_id=0 if pad is None else pad)
  return {'exact_match': share, 'prompts': len(pairs), 'predictions': predictions}


# Table columns: (title, section, key, format).
COLUMNS = (('perplexity', 'perplexity', 'perplexity', '.4f'),
           ('acc', 'multiple_choice', 'acc', '.4f'),
           ('acc_norm', 'multiple_choice', 'acc_norm', '.4f'),
           ('exact_match', 'exact_match', 'exact_match', '.4f'))


def markdown_table(results: dict[str, dict]) -> str:
  """One row per checkpoint, one column per metric measured."""
  first = next(iter(results.values()))
  columns = [c for c in COLUMNS if c[1] in first]
  lines = ['| checkpoint | ' + ' | '.join(c[0] for c in columns) + ' |',
           '|---|' + '---:|' * len(columns)]
  for path, result in results.items():
    cells = [format(result[section][key], spec) for _, section, key, spec in columns]
    lines.append(f'| {path} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)
