"""editing.models.tokenizer against transformers' tokenizers: from tiny GGUF metadata (as
transformers builds them from the same file) and from the Hugging Face directory transformers
saves, with chat templates rendered as transformers renders them."""

import pytest
from transformers import AutoTokenizer

from editing.errors import UserError
from editing.models import gguf as gguf_lib
from editing.models import tokenizer as tokenizer_lib
from tests import tiny_gguf

TEXTS = (
    "hello world, the 12 cats' 345 toys   in\n\nthe hello<think>world",
    "It's <|im_start|>user\n  café\t naïve — “quoted” 2024-01-31\r\n\n end ",
    '',
)
MESSAGES = [{'role': 'system', 'content': 'Be brief & <exact>.'},
            {'role': 'user', 'content': 'Héllo, "world"'},
            {'role': 'assistant', 'content': 'hi'}]
# Block tags on their own indented lines (trim_blocks, lstrip_blocks), a loop control, tojson
# on non-ASCII and HTML characters, a special token variable and the generation prompt.
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'assistant' and loop.last %}{% break %}{% endif %}
    <|im_start|>{{ message['role'] }} {{ message['content'] | tojson }}
    {{ '<|im_end|>\n' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|im_start|>assistant\n' }}
{% endif %}"""


def _gguf_pair(directory, **write_args):
  """(ours, transformers') tokenizers of one tiny GGUF file."""
  tiny_gguf.write(directory / 'm.gguf', tiny_gguf.llama_tensors(), **write_args)
  _, _, ours = gguf_lib.read(str(directory / 'm.gguf'))
  return ours, AutoTokenizer.from_pretrained(directory, gguf_file='m.gguf')


@pytest.mark.parametrize('pre', ['gpt-2', 'llama-bpe', 'qwen2'])
@pytest.mark.parametrize('add_bos', [False, True])
def test_gguf_tokenizer_matches_transformers(tmp_path, pre, add_bos):
  ours, theirs = _gguf_pair(tmp_path, pre=pre, add_bos=add_bos)
  for text in TEXTS:
    ids = theirs(text)['input_ids']
    assert ours.encode(text) == ids, text
    assert ours.decode(ids) == theirs.decode(ids), text
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
        ids, skip_special_tokens=True), text
  assert (ours.encode('hello')[0] == ours.token_id('bos_token')) == add_bos
  assert [ours.special[n] for n in tokenizer_lib.SPECIAL] == [
      theirs.bos_token, theirs.eos_token, theirs.unk_token, theirs.pad_token]


def test_smollm_split_isolates_digits_as_llama_cpp_does(tmp_path):
  """llama.cpp splits each digit off before GPT-2's split for 'smollm', so the vocabulary's
  '12' never forms; under 'gpt-2' it does."""
  ids = {t: i for i, t in enumerate(tiny_gguf.TOKENS)}
  tiny_gguf.write(tmp_path / 'smollm.gguf', tiny_gguf.llama_tensors(), pre='smollm')
  tiny_gguf.write(tmp_path / 'gpt2.gguf', tiny_gguf.llama_tensors(), pre='gpt-2')
  smollm = gguf_lib.read(str(tmp_path / 'smollm.gguf'))[2]
  gpt2 = gguf_lib.read(str(tmp_path / 'gpt2.gguf'))[2]
  assert smollm.encode('hello 12') == [ids['hello'], ids['Ġ'], ids['1'], ids['2']]
  assert gpt2.encode('hello 12') == [ids['hello'], ids['Ġ'], ids['12']]


def test_directory_tokenizer_matches_transformers(tmp_path):
  """transformers' tokenizer saved as a Hugging Face directory (tokenizer.json,
  tokenizer_config.json, chat_template.jinja), BOS added, read back by both."""
  _, theirs = _gguf_pair(tmp_path)
  theirs.chat_template = TEMPLATE
  theirs.add_bos_token = True
  theirs.save_pretrained(tmp_path / 'hf')
  theirs = AutoTokenizer.from_pretrained(tmp_path / 'hf')
  ours = tokenizer_lib.Tokenizer.from_directory(str(tmp_path / 'hf'))
  for text in TEXTS:
    ids = theirs(text)['input_ids']
    assert ours.encode(text) == ids, text
    assert ids[0] == ours.token_id('bos_token')
    assert ours.decode(ids) == theirs.decode(ids), text
  for prompt in (False, True):
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=prompt) == (
        theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt))


def test_gguf_chat_template_renders_as_transformers(tmp_path):
  ours, theirs = _gguf_pair(tmp_path, chat_template=TEMPLATE)
  for messages in (MESSAGES, MESSAGES[1:2]):
    for prompt in (False, True):
      assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == (
          theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))


@pytest.mark.parametrize('template, error', [
    ("{{ raise_exception('roles must alternate') }}", 'roles must alternate'),
    ('{% for m in messages %}{{ m.content }', 'TemplateSyntaxError'),
    ('{{ messages.__class__.__mro__ }}', 'SecurityError'),
    ('{{ messages[0].content.upper() }}{% set x = messages.append(1) %}', 'SecurityError'),
])
def test_template_that_cannot_render_is_refused_by_name(tmp_path, template, error):
  tiny_gguf.write(tmp_path / 'm.gguf', tiny_gguf.llama_tensors(), chat_template=template)
  ours = gguf_lib.read(str(tmp_path / 'm.gguf'))[2]
  with pytest.raises(UserError, match=rf'chat template of .*m\.gguf cannot be rendered: .*{error}'):
    ours.apply_chat_template(MESSAGES)


def test_missing_template_and_unknown_tokenizers_are_refused(tmp_path):
  tiny_gguf.write(tmp_path / 'm.gguf', tiny_gguf.llama_tensors())
  with pytest.raises(UserError, match=r'm\.gguf has no chat template'):
    gguf_lib.read(str(tmp_path / 'm.gguf'))[2].apply_chat_template(MESSAGES)
  tiny_gguf.write(tmp_path / 'pre.gguf', tiny_gguf.llama_tensors(), pre='falcon')
  with pytest.raises(UserError, match=r"pre\.gguf: tokenizer\.ggml\.pre 'falcon' is not known"):
    gguf_lib.read(str(tmp_path / 'pre.gguf'))
  with pytest.raises(UserError, match=r"x\.gguf: tokenizer\.ggml\.model 'llama' is not read"):
    tokenizer_lib.Tokenizer.from_gguf({'tokenizer.ggml.model': 'llama'}, 'x.gguf')
  with pytest.raises(UserError, match=r'has no tokenizer\.json'):
    tokenizer_lib.Tokenizer.from_directory(str(tmp_path))
