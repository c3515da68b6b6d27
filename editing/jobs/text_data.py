"""What a text experiment reads from its config: the decoder's weights and tokenizer, and the
text suite's tasks as token rows (`editing.text_finetune`), negation's control among them as
general text scored by its likelihood.

The decoder is the suite's own (the shipped one, or one pretrained on the suite's mixture),
whose tokenizer has a token per character, or real weights given as `config.weights`: a
Hugging Face causal LM directory or a GGUF file, with the tokenizer it holds
(configs/text_smollm2.py)."""

import functools
from typing import Any

import ml_collections
import numpy as np

from editing import text_finetune
from editing.data import text_suite
from editing.models import gguf
from editing.models import tokenizer as tokenizer_lib
from third_party import hf_decoder


def load_weights(path: str) -> tuple[Any, dict]:
  """(params, config.json's fields) of the decoder at `path`: a .gguf file or a Hugging Face
  directory."""
  if path.endswith('.gguf'):
    config, params, _ = gguf.load_gguf(path)
  else:
    config, params = hf_decoder.load(path)
  return params, config.to_hf()


def tokenizer(config: ml_collections.ConfigDict) -> tokenizer_lib.Tokenizer:
  """The tokenizer of `config.weights`, or the suite's own: a token per character of its
  alphabet."""
  if config.get('weights'):
    return _tokenizer_of(config.weights)
  return tokenizer_lib.characters(text_suite.ALPHABET)


@functools.lru_cache(maxsize=4)
def _tokenizer_of(path: str) -> tokenizer_lib.Tokenizer:
  """A file's tokenizer, built once per process: every task's rows go through it."""
  if path.endswith('.gguf'):
    return gguf.File(path).tokenizer
  return tokenizer_lib.Tokenizer.from_directory(path)


def load_task(config: ml_collections.ConfigDict, name: str) -> text_finetune.TextTask:
  """A text suite task as token rows; `text_suite.HELD_OUT_TEXT`, negation's control, is
  general text scored by its likelihood, in splits of the same sizes."""
  tokens, suite_config = tokenizer(config), config.suite
  if name == text_suite.HELD_OUT_TEXT:
    sizes = (suite_config.train_size, suite_config.val_size, suite_config.test_size)
    text = text_suite.general_text(suite_config.seed, sum(sizes))
    ends = np.cumsum(sizes)
    return text_finetune.TextTask(name, *(
        text_finetune.documents(tokens, text[end - size:end], suite_config.length,
                                metric='likelihood') for size, end in zip(sizes, ends)))
  task = suite_task(config, name)
  return text_finetune.TextTask(name, *(text_finetune.pairs(tokens, split, suite_config.length)
                                        for split in (task.train, task.val, task.test)))


def suite_task(config: ml_collections.ConfigDict, name: str) -> text_suite.Task:
  """A text suite task's (prompt, answer) splits at the config's seed and sizes."""
  suite_config = config.suite
  return text_suite.load_task(name, seed=suite_config.seed, train_size=suite_config.train_size,
                              val_size=suite_config.val_size, test_size=suite_config.test_size)
