"""Scoring text with the decoder: log-likelihoods, perplexity, multiple choice, exact match.

All of it reads one quantity, log p(x_t | x_<t), from a jitted forward over right-padded
rows whose sizes are rounded up (rows to `batch_size`, length to a power of two), so a length
bucket compiles once.

  continuation_log_likelihoods   per-token log p of each continuation given its prompt, and
                                 whether greedy decoding would have produced it
  perplexity                     exp(−mean log p) over a token stream, in windows of `window`
                                 tokens that start every `stride` tokens: each token is scored
                                 once, in the first window holding it and a token before it,
                                 so it sees at least window − stride tokens of context
  documents_perplexity           the same over documents, each scored apart, as
                                 lm-eval-harness's rolling log-likelihood scores them
  file_perplexity                ... over the documents of a .txt, .jsonl or .parquet file
                                 (`read_documents`)
  multiple_choice                lm-eval-harness's convention: acc takes the choice of highest
                                 summed log-likelihood, acc_norm the highest sum divided by the
                                 choice's length in UTF-8 bytes (the harness counts characters,
                                 the same for ASCII; bytes do not favour non-Latin scripts)
  exact_match                    greedy answers, cut at a stop, decoded and stripped of
                                 surrounding whitespace, equal to the reference
"""

import functools
import json
import os
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import generate as generate_lib
from editing.errors import UserError
from editing.models import decoder
from editing.models.decoder_config import DecoderConfig
from editing.models.tokenizer import Tokenizer


@functools.lru_cache(maxsize=None)
def _scorer(config: DecoderConfig, dtype):
  """jit of (params, tokens, mask) -> (log p of token t+1 at t, whether it is the argmax)."""
  model = decoder.Decoder(config, dtype)

  def score(params, tokens, mask):
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    logits, _ = model.apply({'params': params}, tokens, positions, mask)
    log_p = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    following = tokens[:, 1:, None]
    chosen = jnp.take_along_axis(log_p, following, axis=-1)[..., 0]
    return chosen, jnp.argmax(log_p, axis=-1) == following[..., 0]

  return jax.jit(score)


def _next_token_scores(config, params, rows: Sequence[Sequence[int]], batch_size: int, dtype):
  """For each row of tokens, (log p(x_{t+1} | x_≤t), x_{t+1} is the argmax) for t < len − 1."""
  longest = max(len(r) for r in rows)
  if longest > config.max_position_embeddings:
    raise UserError(f'a sequence of {longest} tokens exceeds max_position_embeddings = '
                    f'{config.max_position_embeddings}')
  length = generate_lib.bucket_size(longest, 8)
  out = []
  for start in range(0, len(rows), batch_size):
    chunk = rows[start:start + batch_size]
    tokens = np.zeros((batch_size, length), np.int32)
    mask = np.zeros((batch_size, length), bool)
    for i, row in enumerate(chunk):
      tokens[i, :len(row)], mask[i, :len(row)] = row, True
    log_p, greedy = jax.device_get(_scorer(config, jnp.dtype(dtype))(params, tokens, mask))
    out += [(log_p[i, :len(row) - 1], greedy[i, :len(row) - 1]) for i, row in enumerate(chunk)]
  return out


class Continuation(NamedTuple):
  """log_likelihoods: per continuation token, log p(token | prompt, earlier ones); greedy:
  whether greedy decoding from the prompt yields the whole continuation."""

  log_likelihoods: np.ndarray
  greedy: bool

  @property
  def total(self) -> float:
    return float(np.sum(self.log_likelihoods, dtype=np.float64))


def continuation_log_likelihoods(config: DecoderConfig, params, prompts: Sequence[Sequence[int]],
                                 continuations: Sequence[Sequence[int]], *, batch_size: int = 8,
                                 dtype=jnp.float32) -> list[Continuation]:
  """How likely each continuation is after its prompt, token by token."""
  if len(prompts) != len(continuations):
    raise UserError(f'{len(prompts)} prompts for {len(continuations)} continuations')
  for what, seqs in (('prompt', prompts), ('continuation', continuations)):
    if any(len(s) == 0 for s in seqs):
      raise UserError(f'an empty {what}: a continuation is scored after at least one token '
                      '(a BOS token, say), and has at least one')
  rows = [list(p) + list(c) for p, c in zip(prompts, continuations)]
  scores = _next_token_scores(config, params, rows, batch_size, dtype)
  return [Continuation(log_p[len(p) - 1:], bool(greedy[len(p) - 1:].all()))
          for p, (log_p, greedy) in zip(prompts, scores)]


class Perplexity(NamedTuple):
  perplexity: float
  negative_log_likelihood: float  # summed over the scored tokens
  tokens: int  # scored: all but the first of each stream


def windows(count: int, window: int, stride: int) -> list[tuple[int, int, int]]:
  """(start, first scored, end) of each window over `count` tokens: tokens [start, end) are
  read and [first scored, end) scored."""
  if not 0 < stride < window:
    raise UserError(f'perplexity: stride = {stride} must be at least 1 and below window = '
                    f'{window}, so that every scored token has context in its window')
  out, scored, start = [], 1, 0
  while scored < count:
    end = min(start + window, count)
    out.append((start, scored, end))
    scored, start = end, start + stride
  return out


def perplexity(config: DecoderConfig, params, tokens: Sequence[int], *, window: int,
               stride: int, batch_size: int = 8, dtype=jnp.float32) -> Perplexity:
  """exp(−(1/n) Σ_t log p(x_t | the window's tokens before t)) over tokens 1..n."""
  if len(tokens) < 2:
    raise UserError(f'perplexity needs at least 2 tokens, got {len(tokens)}')
  return _pooled_perplexity(config, params, [list(tokens)], window, stride, batch_size, dtype)


def _pooled_perplexity(config, params, streams: Sequence[Sequence[int]], window: int,
                       stride: int, batch_size: int, dtype) -> Perplexity:
  """exp(−Σ log p / n) over tokens 1.. of every stream, each in windows of its own: no
  window crosses from one stream into the next. The windows of all streams share batches."""
  spans = [(i, span) for i, stream in enumerate(streams)
           for span in windows(len(stream), window, stride)]
  scores = _next_token_scores(config, params, [list(streams[i][s:e]) for i, (s, _, e) in spans],
                              batch_size, dtype)
  # Entry j of a window's scores is token start + j + 1.
  picked = np.concatenate([log_p[first - start - 1:] for (_, (start, first, _)), (log_p, _)
                           in zip(spans, scores)]).astype(np.float64)
  nll = float(-picked.sum())
  return Perplexity(float(np.exp(nll / len(picked))), nll, len(picked))


TEXT_SUFFIXES = ('.txt', '.jsonl', '.parquet')


def read_documents(path: str, field: str = 'text') -> list[str]:
  """The non-empty documents of a text file: a .txt file is one document (its whole text,
  UTF-8), a .jsonl file one per line (the string `field` of the line's object), a .parquet
  file one per row (its string column `field`). Another suffix, a file that cannot be read, a
  missing or non-string field and a file without text are refused, naming the file."""
  suffix = os.path.splitext(path)[1].lower()
  readers = {'.txt': _read_txt, '.jsonl': _read_jsonl, '.parquet': _read_parquet}
  if suffix not in readers:
    raise UserError(f'{path}: text to score is read from {", ".join(TEXT_SUFFIXES)} files, '
                    f'not {suffix or "a file without a suffix"}')
  if not os.path.isfile(path):
    raise UserError(f'{path} does not exist')
  try:
    documents = [d for d in readers[suffix](path, field) if d]
  except UnicodeDecodeError as e:
    raise UserError(f'{path} is not UTF-8 text ({e})') from None
  if not documents:
    raise UserError(f'{path} holds no text to score')
  return documents


def _read_txt(path: str, field: str) -> list[str]:
  del field  # the whole file is the one document
  with open(path, encoding='utf-8', newline='') as f:  # newlines kept as written
    return [f.read()]


def jsonl_objects(path: str) -> list[tuple[int, dict]]:
  """(line number, object) of each non-blank line of the .jsonl file `path`; a line that is
  not a JSON object is named."""
  objects = []
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise UserError(f'{path}, line {number}: not a JSON object ({e})') from None
      if not isinstance(record, dict):
        raise UserError(f'{path}, line {number}: not a JSON object')
      objects.append((number, record))
  return objects


def _read_jsonl(path: str, field: str) -> list[str]:
  documents = []
  for number, record in jsonl_objects(path):
    if field not in record:
      raise UserError(f'{path}, line {number}: no field {field!r} (name the field of the '
                      'text to score)')
    if not isinstance(record[field], str):
      raise UserError(f'{path}, line {number}: field {field!r} is a '
                      f'{type(record[field]).__name__}, not text')
    documents.append(record[field])
  return documents


def _read_parquet(path: str, field: str) -> list[str]:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  try:
    file = pq.ParquetFile(path)
  except (OSError, ValueError) as e:
    raise UserError(f'{path} is not a readable parquet file ({e})') from None
  schema = file.schema_arrow
  if field not in schema.names:
    raise UserError(f'{path} has no column {field!r}; it has {schema.names}')
  kind = schema.field(field).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
    raise UserError(f'{path}: column {field!r} holds {kind}, not text')
  documents = file.read(columns=[field]).column(field).to_pylist()
  if None in documents:
    raise UserError(f'{path}: row {documents.index(None)} of column {field!r} is null')
  return documents


def file_perplexity(config: DecoderConfig, params, tokenizer: Tokenizer, path: str, *,
                    window: int, stride: int, field: str = 'text', batch_size: int = 8,
                    dtype=jnp.float32) -> Perplexity:
  """Perplexity of a text file's documents (`read_documents`), as lm-eval-harness's rolling
  log-likelihood scores a corpus such as wikitext (`documents_perplexity`)."""
  return documents_perplexity(config, params, tokenizer, read_documents(path, field),
                              window=window, stride=stride, batch_size=batch_size, dtype=dtype,
                              source=path)


def documents_perplexity(config: DecoderConfig, params, tokenizer: Tokenizer,
                         documents: Sequence[str], *, window: int, stride: int,
                         batch_size: int = 8, dtype=jnp.float32,
                         source: str = 'the documents') -> Perplexity:
  """Perplexity of `documents`, each encoded without special tokens and preceded by one
  prefix token (BOS, or EOS where the model has no BOS), so that every token of its text is
  scored, in windows within the document (no context crosses documents); perplexity =
  exp(Σ_d NLL_d / Σ_d n_d) over documents d of n_d tokens."""
  prefix = tokenizer.prefix_id()
  streams = [[prefix] + tokenizer.encode(d, add_special_tokens=False) for d in documents]
  streams = [s for s in streams if len(s) > 1]
  if not streams:
    raise UserError(f'{source}: its text encodes to no tokens')
  return _pooled_perplexity(config, params, streams, window, stride, batch_size, dtype)


class Choice(NamedTuple):
  log_likelihoods: np.ndarray  # summed, per choice
  acc: int  # the index of the choice of highest log-likelihood
  acc_norm: int  # ... of highest log-likelihood per UTF-8 byte of its text


def multiple_choice(config: DecoderConfig, params, prompt: Sequence[int],
                    choices: Sequence[Sequence[int]], texts: Sequence[str], *,
                    batch_size: int = 8, dtype=jnp.float32) -> Choice:
  """Which of `choices` (token lists, whose strings are `texts`) follows `prompt` best."""
  return multiple_choice_batch(config, params, [(prompt, choices, texts)],
                               batch_size=batch_size, dtype=dtype)[0]


def multiple_choice_batch(config: DecoderConfig, params, questions, *, batch_size: int = 8,
                          dtype=jnp.float32) -> list[Choice]:
  """`multiple_choice` of many (prompt, choices, texts) at once, batched together."""
  pairs = []
  for prompt, choices, texts in questions:
    if len(choices) != len(texts) or not choices:
      raise UserError(f'a question has {len(choices)} choices and {len(texts)} texts')
    pairs += [(prompt, c) for c in choices]
  scored = continuation_log_likelihoods(config, params, [p for p, _ in pairs],
                                        [c for _, c in pairs], batch_size=batch_size,
                                        dtype=dtype)
  out, at = [], 0
  for _, choices, texts in questions:
    sums = np.array([s.total for s in scored[at:at + len(choices)]])
    at += len(choices)
    per_byte = sums / np.array([max(len(t.encode('utf-8')), 1) for t in texts])
    out.append(Choice(sums, int(np.argmax(sums)), int(np.argmax(per_byte))))
  return out


def cut_at_stop(tokens: Sequence[int], eos_ids: Sequence[int] = (),
                stop_sequences: Sequence[Sequence[int]] = ()) -> list[int]:
  """The tokens before the first EOS id or the first stop sequence."""
  tokens = list(tokens)
  for end in range(len(tokens) + 1):
    for stop in stop_sequences:
      if tokens[end:end + len(stop)] == list(stop):
        return tokens[:end]
    if end < len(tokens) and tokens[end] in eos_ids:
      return tokens[:end]
  return tokens


def exact_match(config: DecoderConfig, params, prompts: Sequence[Sequence[int]],
                answers: Sequence[str], decode: Callable[[list[int]], str], *,
                max_new_tokens: int, eos_ids: Sequence[int] = (),
                stop_sequences: Sequence[Sequence[int]] = (),
                pad_id: int = 0) -> tuple[float, list[str]]:
  """(the share of prompts whose greedy answer equals its reference, the answers), each
  answer cut at its stop, decoded and stripped of surrounding whitespace, as the reference."""
  if len(prompts) != len(answers):
    raise UserError(f'{len(prompts)} prompts for {len(answers)} answers')
  generated = generate_lib.generate(config, params, prompts, max_new_tokens=max_new_tokens,
                                    eos_ids=eos_ids, stop_sequences=stop_sequences,
                                    pad_id=pad_id)
  predictions = [decode(cut_at_stop(row[:n], eos_ids, stop_sequences)).strip()
                 for row, n in zip(generated.tokens, generated.lengths)]
  hits = [p == a.strip() for p, a in zip(predictions, answers)]
  return float(np.mean(hits)), predictions
