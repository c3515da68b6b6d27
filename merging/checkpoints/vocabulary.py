"""The inputs' vocabularies. A merge combines row r of every model's embedding and output
matrices, which is right only where id r is one token in every model: models whose tokenizers
give an id to different tokens are refused by name, never merged misaligned. (mergekit's
`tokenizer_source: union` and its row alignment are not built here.)"""

import os
from typing import Sequence

import tokenizers

from editing.errors import UserError

TOKENIZER = 'tokenizer.json'


def of(directory: str) -> dict[int, str] | None:
  """{id: token} of the tokenizer.json in `directory`, added tokens included; None without
  one."""
  path = os.path.join(directory, TOKENIZER)
  if not os.path.isfile(path):
    return None
  try:
    vocabulary = tokenizers.Tokenizer.from_file(path).get_vocab(with_added_tokens=True)
  except Exception as e:  # tokenizers raises bare Exceptions for malformed files
    raise UserError(f'{path} cannot be read as a tokenizer ({e})') from None
  return {i: token for token, i in vocabulary.items()}


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
        'differ), and a merge combines the rows of one id; merge models of one tokenizer')
