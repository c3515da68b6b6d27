"""Text in: a checkpoint's own tokenizer.json, through the `tokenizers` library.

Every batch is padded (and truncated) to one fixed length, so one compiled program serves all
of them: the length tokenizer.json sets, else `max_length`.
"""

import json
import os

import numpy as np
import tokenizers

from editing.errors import UserError


class Tokenizer:
  """texts -> {'input_ids', 'attention_mask', 'token_type_ids'}, int32 (batch, length)."""

  def __init__(self, path: str, max_length: int | None = None):
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(path, 'tokenizer.json') if os.path.isdir(path) else path
    if not os.path.exists(file):
      raise FileNotFoundError(f'no tokenizer.json at {file}')
    self._tokenizer = tokenizers.Tokenizer.from_file(file)
    truncation = self._tokenizer.truncation or {}
    length = max_length or truncation.get('max_length')
    if not length:
      raise UserError(f'{file} sets no length; pass max_length')
    padding = self._tokenizer.padding or self._padding_from_config(directory, file)
    self._tokenizer.enable_truncation(length)
    self._tokenizer.enable_padding(length=length, pad_id=padding['pad_id'],
                                   pad_token=padding['pad_token'])
    self.length = length

  def _padding_from_config(self, directory: str, file: str) -> dict:
    config = os.path.join(directory, 'tokenizer_config.json')
    token = None
    if os.path.exists(config):
      with open(config) as f:
        token = json.load(f).get('pad_token')
    token = token if isinstance(token, str) else None
    if token is None or self._tokenizer.token_to_id(token) is None:
      raise UserError(f'{file} sets no padding and {config} names no pad_token it knows')
    return {'pad_id': self._tokenizer.token_to_id(token), 'pad_token': token}

  def __call__(self, texts: list[str]) -> dict[str, np.ndarray]:
    encodings = self._tokenizer.encode_batch(list(texts))
    as_array = lambda field: np.asarray([getattr(e, field) for e in encodings], np.int32)
    return {'input_ids': as_array('ids'), 'attention_mask': as_array('attention_mask'),
            'token_type_ids': as_array('type_ids')}
