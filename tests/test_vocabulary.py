"""A checkpoint merge refuses models whose tokenizers give an id to different tokens, before
anything is written, and merges those of one tokenizer."""

import os

import pytest

from configs import merge_checkpoints
from editing.errors import UserError
from editing.models import tokenizer as tokenizer_lib
from merging import checkpoints
from tests.test_upscaling import ALPHABET, llama


def merge(tmp_path, base, model):
  config = merge_checkpoints.get_config()
  config.update(base=str(base), models=str(model), method='task_arithmetic',
                output=str(tmp_path / 'merged'))
  return checkpoints.run(config, str(tmp_path))


def test_a_model_of_another_vocabulary_of_the_same_size_is_refused_by_the_first_id(tmp_path):
  llama(tmp_path / 'base', 0)
  llama(tmp_path / 'tuned', 1)
  merge(tmp_path / 'same', tmp_path / 'base', tmp_path / 'tuned')
  assert os.path.exists(tmp_path / 'same' / 'merged' / 'model.safetensors')

  swapped = ALPHABET[1] + ALPHABET[0] + ALPHABET[2:]  # ids 4 and 5 trade their letters
  tokenizer_lib.characters(swapped).save(str(tmp_path / 'tuned'))
  with pytest.raises(UserError, match=r"tuned has another vocabulary than the base .*base: id 4 "
                                      r"is 'b' there and 'a' in the base \(2 ids differ\)"):
    merge(tmp_path / 'other', tmp_path / 'base', tmp_path / 'tuned')
  assert not os.path.exists(tmp_path / 'other' / 'merged')
