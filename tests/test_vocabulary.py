"""The vocabularies of a checkpoint merge: models whose tokenizers give an id to different
tokens are refused before anything is written, unless a tokenizer source aligns their rows,
which then merge as a numpy port of mergekit's rules says, into a model and tokenizer that
transformers loads."""

import json
import os

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

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


# Three vocabularies of one size: the base's; one lacking x, y, z and holding 1, 2, 3 in their
# place; one of the base's letters in another order.
LACKING = ALPHABET.replace('x', '1').replace('y', '2').replace('z', '3')
SHUFFLED = ALPHABET[::-1]


@pytest.fixture(scope='module', name='vocabularies')
def vocabularies_fixture(tmp_path_factory):
  root = tmp_path_factory.mktemp('vocabularies')
  for seed, (name, alphabet) in enumerate((('base', ALPHABET), ('lacking', LACKING),
                                           ('shuffled', SHUFFLED))):
    llama(root / name, seed)
    tokenizer_lib.characters(alphabet).save(str(root / name))
  return root


def mergekit_rows(matrices, vocabularies, out_tokens, pad_to=0):
  """mergekit's PermutedEmbeddings, in numpy: per input, its own row of each output token it
  has; else the only owner's row, the base's (input 0), the owners' mean, or zero; padding
  rows each input's mean."""
  out = []
  for matrix, vocabulary in zip(matrices, vocabularies):
    rows = []
    for token in out_tokens:
      owners = [k for k, v in enumerate(vocabularies) if token in v]
      if token in vocabulary:
        rows.append(matrix[vocabulary[token]])
      elif len(owners) == 1:
        rows.append(matrices[owners[0]][vocabularies[owners[0]][token]])
      elif not owners:
        rows.append(np.zeros(matrix.shape[1]))
      elif 0 in owners:
        rows.append(matrices[0][vocabularies[0][token]])
      else:
        rows.append(np.mean([matrices[k][vocabularies[k][token]] for k in owners], axis=0))
    rows = np.array(rows, np.float64)
    padded = -(-len(rows) // pad_to) * pad_to if pad_to else len(rows)
    out.append(np.concatenate([rows, np.repeat(rows.mean(0, keepdims=True),
                                               padded - len(rows), axis=0)]))
  return out


def vocabulary_of(directory):
  backend = tokenizer_lib.Tokenizer.from_directory(str(directory)).backend
  return backend.get_vocab(with_added_tokens=True)


@pytest.mark.parametrize('source,pad', [('union', 0), ('base', 16)])
def test_aligned_rows_merge_as_mergekits_rules_say(tmp_path, vocabularies, source, pad):
  root = vocabularies
  names = ('base', 'lacking', 'shuffled')
  block = f'tokenizer: {{source: {source}, pad_to_multiple_of: {pad}}}' if pad else \
      f'tokenizer_source: {source}'
  (tmp_path / 'merge.yaml').write_text(f'''
merge_method: task_arithmetic
base_model: {root / 'base'}
models:
  - model: {root / 'lacking'}
  - model: {root / 'shuffled'}
parameters: {{lambda: 0.5}}
{block}
''')
  config = merge_checkpoints.get_config()
  config.update(mergekit=str(tmp_path / 'merge.yaml'), output=str(tmp_path / 'merged'))
  checkpoints.run(config, str(tmp_path))

  vocabularies = [vocabulary_of(root / n) for n in names]
  out_vocabulary = vocabulary_of(tmp_path / 'merged')
  out_tokens = sorted(out_vocabulary, key=out_vocabulary.get)
  base_tokens = sorted(vocabularies[0], key=vocabularies[0].get)
  expected_tokens = base_tokens + (['1', '2', '3'] if source == 'union' else [])
  assert out_tokens == expected_tokens
  merged = safetensors.numpy.load_file(str(tmp_path / 'merged' / 'model.safetensors'))
  for tensor in ('model.embed_tokens.weight', 'lm_head.weight'):
    inputs = [safetensors.numpy.load_file(str(root / n / 'model.safetensors'))[tensor]
              for n in names]
    base, *models = mergekit_rows(inputs, vocabularies, out_tokens, pad)
    expected = base + 0.5 * sum(m - base for m in models)
    np.testing.assert_allclose(merged[tensor], expected, atol=1e-6, err_msg=tensor)
  with open(tmp_path / 'merged' / 'config.json') as f:
    assert json.load(f)['vocab_size'] == len(expected)

  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / 'merged'))
  tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path / 'merged'))
  text = 'abc 1 2' if source == 'union' else 'abc xyz'
  ids = tokenizer(text)['input_ids']
  assert ids == [out_vocabulary['<s>']] + [out_vocabulary[c] for c in text]
  assert model(torch.tensor([ids])).logits.shape[-1] == len(expected)


def test_a_tokenizer_block_with_both_forms_or_per_token_sources_is_refused(tmp_path,
                                                                           vocabularies):
  root = vocabularies
  head = f'merge_method: task_arithmetic\nbase_model: {root / "base"}\n' \
         f'models:\n  - model: {root / "lacking"}\n'
  for extra, message in (
      ('tokenizer_source: union\ntokenizer: {source: base}\n', 'not both'),
      ('tokenizer: {source: union, tokens: {"<x>": {source: base}}}\n',
       r'tokenizer.tokens not supported here'),
      ('tokenizer: {pad_to_multiple_of: -8}\n', 'pad_to_multiple_of = -8')):
    (tmp_path / 'merge.yaml').write_text(head + extra)
    config = merge_checkpoints.get_config()
    config.update(mergekit=str(tmp_path / 'merge.yaml'), output=str(tmp_path / 'merged'))
    with pytest.raises(UserError, match=message):
      checkpoints.run(config, str(tmp_path))
    assert not os.path.exists(tmp_path / 'merged')
