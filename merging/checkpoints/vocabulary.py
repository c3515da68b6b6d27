"""The inputs' vocabularies, and the rows of their embedding and output matrices aligned to one.

A merge combines row r of every model's `model.embed_tokens.weight` and `lm_head.weight`,
which is right only where id r is one token in every model. Without a tokenizer source, models
whose tokenizer.json gives an id to another token than the base's are refused by name, never
merged misaligned. With one (mergekit's `tokenizer_source`, or its `tokenizer:` block's
`source` and `pad_to_multiple_of`) the output takes that vocabulary and each model's rows are
permuted onto it [mergekit tokenizer/build.py, tokenizer/embed.py]:

  base        the base's tokenizer
  union       the base's ids, then every other model's tokens the base lacks (its regular
              tokens first, as added tokens, model by model in the recipe's order; then the
              added and special tokens), each once
  <a path>    that checkpoint's tokenizer

A model's row for a token it has is its own. For a token it lacks, the row is, in order: the
one model's that has it, when only one has it; the base's, when the base has it; the mean of
the rows of the models that have it; zero, when none has it. With pad_to_multiple_of m, the
matrices get rows up to the next multiple of m, each model's padding rows the mean of its
rows. The merge method then merges the aligned rows as any others (mergekit's methods see no
mask either: a model's filled row is its input). Differences from mergekit, by choice: the
union's order follows the recipe (mergekit's comes from a set, and varies between runs), the
mean is taken in float32 (mergekit's in the tensors' dtype), and a tokenizer with ids at or
beyond its model's vocab_size is refused (mergekit strips such ids from the base's).
"""

import dataclasses
import json
import os
import threading
from typing import Sequence

import numpy as np
import tokenizers

from editing.errors import UserError

TOKENIZER = 'tokenizer.json'
TOKENIZER_CONFIG = 'tokenizer_config.json'
EMBEDDINGS = ('model.embed_tokens.weight', 'lm_head.weight')
SOURCES = ('base', 'union')  # or a checkpoint's path


def of(directory: str) -> dict[int, str] | None:
  """{id: token} of the tokenizer.json in `directory`, added tokens included; None without
  one."""
  backend = _tokenizer(directory)
  if backend is None:
    return None
  return {i: token for token, i in backend.get_vocab(with_added_tokens=True).items()}


def check_same(base: str, models: Sequence[str]) -> None:
  """Every model with a tokenizer.json gives each id the token the base's gives it."""
  ours = of(base)
  for model in models:
    theirs = of(model) if ours is not None else None
    if theirs is None or theirs == ours:
      continue
    differing = sorted(i for i in ours.keys() | theirs.keys() if ours.get(i) != theirs.get(i))
    first = differing[0]
    raise UserError(
        f'{model} has another vocabulary than the base {base}: id {first} is '
        f'{theirs.get(first)!r} there and {ours.get(first)!r} in the base ({len(differing)} ids '
        'differ), and a merge combines the rows of one id; set config.tokenizer (union, base '
        'or a model) to align the rows to one vocabulary')


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """The output's tokenizer and, per input (the base first), the old id of each output id
  (−1: the input lacks the token)."""

  tokenizer: tokenizers.Tokenizer
  config: dict  # the output's tokenizer_config.json
  rows: int  # the output matrices' rows: the vocabulary, padded
  old_ids: tuple[np.ndarray, ...]

  def files(self) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json of the output."""
    return {TOKENIZER: json.loads(self.tokenizer.to_str()), TOKENIZER_CONFIG: self.config}


def build(source: str, base: str, models: Sequence[str], embedding_rows: Sequence[int],
          pad_to_multiple_of: int = 0) -> Vocabulary:
  """The vocabulary `source` names over the base and `models` (each input's embedding having
  `embedding_rows` rows, the base's first)."""
  inputs = [base, *models]
  backends = []
  for path, rows in zip(inputs, embedding_rows):
    backend = _tokenizer(path)
    if backend is None:
      raise UserError(f'config.tokenizer = {source}: {path} has no {TOKENIZER} to align its '
                      'rows by')
    largest = max(backend.get_vocab(with_added_tokens=True).values())
    if largest >= rows:
      raise UserError(f'{path}/{TOKENIZER} has id {largest}, beyond its embedding\'s {rows} '
                      'rows')
    backends.append(backend)
  if source == 'union':
    out = _union(backends)
  elif source == 'base':
    out = tokenizers.Tokenizer.from_str(backends[0].to_str())
  else:
    out = _tokenizer(source)
    if out is None:
      raise UserError(f'config.tokenizer = {source}: no {TOKENIZER} there')
  vocabulary = out.get_vocab(with_added_tokens=True)
  size = max(vocabulary.values()) + 1
  if sorted(vocabulary.values()) != list(range(size)):
    raise UserError(f'config.tokenizer = {source}: its ids are not 0..{size - 1} without gaps')
  tokens = sorted(vocabulary, key=vocabulary.get)
  old_ids = tuple(np.array([b.token_to_id(t) if b.token_to_id(t) is not None else -1
                            for t in tokens], np.int64) for b in backends)
  rows = -(-size // pad_to_multiple_of) * pad_to_multiple_of if pad_to_multiple_of else size
  return Vocabulary(out, _tokenizer_config(base, out), rows, old_ids)


def _tokenizer(directory: str) -> tokenizers.Tokenizer | None:
  path = os.path.join(directory, TOKENIZER)
  if not os.path.isfile(path):
    return None
  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises bare Exceptions for malformed files
    raise UserError(f'{path} cannot be read as a tokenizer ({e})') from None


def _union(backends: Sequence[tokenizers.Tokenizer]) -> tokenizers.Tokenizer:
  """The base's tokenizer with every other input's tokens it lacks: regular tokens first,
  then added ones with their own settings (the first input's, where several add one)."""
  out = tokenizers.Tokenizer.from_str(backends[0].to_str())
  known = set(out.get_vocab(with_added_tokens=True))
  added = []
  for backend in backends[1:]:
    specials = backend.get_added_tokens_decoder()
    for token in sorted(backend.get_vocab(with_added_tokens=False),
                        key=backend.get_vocab(with_added_tokens=False).get):
      if token not in known and token not in {t.content for t in specials.values()}:
        out.add_tokens([tokenizers.AddedToken(token, normalized=True)])
        known.add(token)
    added += [token for _, token in sorted(specials.items())]
  for token in added:
    if token.content not in known:
      adding = out.add_special_tokens if token.special else out.add_tokens
      adding([tokenizers.AddedToken(token.content, single_word=token.single_word,
                                    lstrip=token.lstrip, rstrip=token.rstrip,
                                    normalized=token.normalized, special=token.special)])
      known.add(token.content)
  return out


def _tokenizer_config(base: str, out: tokenizers.Tokenizer) -> dict:
  """The base's tokenizer_config.json with the output's added tokens."""
  path = os.path.join(base, TOKENIZER_CONFIG)
  config = {}
  if os.path.isfile(path):
    with open(path) as f:
      config = json.load(f)
  config['added_tokens_decoder'] = {
      str(i): {'content': t.content, 'lstrip': t.lstrip, 'normalized': t.normalized,
               'rstrip': t.rstrip, 'single_word': t.single_word, 'special': t.special}
      for i, t in sorted(out.get_added_tokens_decoder().items())}
  return config


class Aligned:
  """Each input's embedding and output matrices with rows on `vocabulary`, made for all inputs
  at once when one asks for a name (the fill of a row reads the others'), then kept."""

  def __init__(self, vocabulary: Vocabulary, readers: Sequence):
    self.vocabulary, self._readers = vocabulary, list(readers)
    self._made: dict[str, list[np.ndarray]] = {}
    self._lock = threading.Lock()

  def matrix(self, index: int, name: str) -> np.ndarray:
    """Input `index`'s (0: the base) aligned matrix `name`, in its stored dtype."""
    with self._lock:
      if name not in self._made:
        self._made[name] = _aligned([r.tensor(name) for r in self._readers],
                                    self.vocabulary.old_ids, self.vocabulary.rows)
      return self._made[name][index]


def _aligned(matrices: Sequence[np.ndarray], old_ids: Sequence[np.ndarray],
             rows: int) -> list[np.ndarray]:
  """Each input's rows on the output ids: its own where it has the token, else the fill
  (the module's docstring); padding rows its mean."""
  has = np.stack([ids >= 0 for ids in old_ids])  # (inputs, vocabulary)
  own = [m.astype(np.float32)[np.maximum(ids, 0)] for m, ids in zip(matrices, old_ids)]
  owners = has.sum(0)
  mean = sum(np.where(h[:, None], o, 0) for h, o in zip(has, own)) / np.maximum(owners, 1)[:, None]
  only = np.argmax(has, axis=0)  # the first owner: the only one where there is one
  fill = np.where((owners == 1)[:, None], np.stack(own)[only, np.arange(len(only))],
                  np.where(has[0][:, None], own[0], mean))
  out = []
  for h, o, m in zip(has, own, matrices):
    aligned = np.where(h[:, None], o, fill)
    padding = np.broadcast_to(aligned.mean(0), (rows - len(aligned), aligned.shape[1]))
    out.append(np.concatenate([aligned, padding]).astype(m.dtype))
  return out


class View:
  """A checkpoint read with its embedding and output matrices aligned (`hf.Reader`)."""

  def __init__(self, reader, aligned: Aligned, index: int):
    self._reader, self._aligned, self._index = reader, aligned, index
    self.path, self.files = reader.path, reader.files
    self.config = {**reader.config, 'vocab_size': aligned.vocabulary.rows} if reader.config \
        else reader.config

  def header(self, name: str):
    shape, dtype = self._reader.header(name)
    return ((self._aligned.vocabulary.rows, *shape[1:]) if name in EMBEDDINGS else shape), dtype

  def tensor(self, name: str) -> np.ndarray:
    if name in EMBEDDINGS:
      return self._aligned.matrix(self._index, name)
    return self._reader.tensor(name)

  def read(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    if name not in EMBEDDINGS:
      return self._reader.read(name, start, stop, out)
    block = self._aligned.matrix(self._index, name).reshape(-1)[start:stop]
    if out is None:
      return block.copy()
    out[:len(block)] = block
    return out[:len(block)]
