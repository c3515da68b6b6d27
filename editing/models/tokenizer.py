"""Tokenizers of decoder language models, over the `tokenizers` library.

A `Tokenizer` comes from a Hugging Face directory (tokenizer.json, with tokenizer_config.json
for the special tokens and the chat template, or chat_template.jinja beside it) or from a GGUF
file's metadata (llama.cpp's `tokenizer.ggml.*` keys and `tokenizer.chat_template`). It encodes
and decodes as transformers does, adding BOS (and EOS) where the model's files say so (but
without transformers' clean_up_tokenization_spaces, which it applies to non-BPE models), and
renders chat templates in a sandboxed jinja2 environment set up as transformers sets up its own
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson`
that leaves non-ASCII and HTML characters as they are).

From GGUF, byte-level BPE (`tokenizer.ggml.model` "gpt2") is read: the vocabulary and merges
as stored, control tokens as special tokens, user-defined ones as added tokens, and the text
split before BPE by the regular expressions that `tokenizer.ggml.pre` names (`PRE_TOKENIZERS`,
as llama.cpp splits it).
"""

import datetime
import functools
import json
import os
from typing import Any, Mapping, Sequence

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from editing.errors import UserError

SPECIAL = ('bos_token', 'eos_token', 'unk_token', 'pad_token')

# GPT-2's split: contractions, letters, digits, other symbols, each with one leading space.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = r'\p{N}'
# tokenizer.ggml.pre -> the splits applied in turn, each piece isolated.
PRE_TOKENIZERS = {
    'gpt-2': (_GPT2,),
    'smollm': (_DIGITS, _GPT2),
    'starcoder': (_DIGITS, _GPT2),
    'llama-bpe': (_LLAMA3,),
    'qwen2': (_QWEN2,),
    'deepseek-r1-qwen': (_QWEN2,),
}


class Tokenizer:
  """Text to token ids and back, with the model's special tokens and chat template."""

  def __init__(self, backend: tokenizers.Tokenizer, special: Mapping[str, str | None],
               chat_template: str | None, source: str):
    self.backend = backend
    self.special = dict(special)  # {'bos_token': '<s>', ...}, None where the model has none
    self.chat_template = chat_template
    self.source = source  # the file or directory it was read from, for messages

  @classmethod
  def from_directory(cls, directory: str) -> 'Tokenizer':
    """The tokenizer of a Hugging Face model directory."""
    path = os.path.join(directory, 'tokenizer.json')
    if not os.path.exists(path):
      raise UserError(f'{directory} has no tokenizer.json')
    try:
      backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises bare Exceptions for malformed files
      raise UserError(f'{path} cannot be read as a tokenizer ({e})') from None
    settings = _read_json(os.path.join(directory, 'tokenizer_config.json'))
    special = {name: _token_content(settings.get(name)) for name in SPECIAL}
    if 'add_bos_token' in settings or 'add_eos_token' in settings:
      backend.post_processor = _bos_eos_processor(
          backend, special, settings.get('add_bos_token', False),
          settings.get('add_eos_token', False), path)
    return cls(backend, special, _directory_chat_template(directory, settings), directory)

  @classmethod
  def from_gguf(cls, metadata: Mapping[str, Any], source: str) -> 'Tokenizer':
    """The tokenizer that a GGUF file's metadata (`{key: value}`) describes."""
    kind = metadata.get('tokenizer.ggml.model')
    if kind != 'gpt2':
      raise UserError(f'{source}: tokenizer.ggml.model {kind!r} is not read here; only "gpt2" '
                      '(byte-level BPE)')
    tokens = list(metadata.get('tokenizer.ggml.tokens', ()))
    merges = [tuple(merge.split(' ')) for merge in metadata.get('tokenizer.ggml.merges', ())]
    try:
      backend = tokenizers.Tokenizer(models.BPE(
          vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    except Exception as e:  # tokenizers raises bare Exceptions for inconsistent vocabularies
      raise UserError(f'{source}: tokenizer.ggml.tokens and .merges do not make a BPE '
                      f'vocabulary ({e})') from None
    backend.pre_tokenizer = _gguf_pre_tokenizer(metadata.get('tokenizer.ggml.pre'), source)
    backend.decoder = decoders.ByteLevel()
    _add_gguf_tokens(backend, tokens, metadata.get('tokenizer.ggml.token_type', ()))
    special = {name: _gguf_token(metadata, tokens, name, source) for name in SPECIAL}
    backend.post_processor = _bos_eos_processor(
        backend, special, metadata.get('tokenizer.ggml.add_bos_token', False),
        metadata.get('tokenizer.ggml.add_eos_token', False), source)
    return cls(backend, special, metadata.get('tokenizer.chat_template'), source)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text`, with BOS/EOS where the model adds them."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """The text of token ids."""
    return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def token_id(self, name: str) -> int | None:
    """The id of a special token by role ('bos_token', 'eos_token', ...), None if it has none."""
    token = self.special.get(name)
    return None if token is None else self.backend.token_to_id(token)

  def prefix_id(self) -> int:
    """The token a scored text starts with, so that its first token has a context: BOS, or EOS
    where the model has no BOS (as lm-eval-harness starts a rolling window)."""
    for name in ('bos_token', 'eos_token'):
      token = self.token_id(name)
      if token is not None:
        return token
    raise UserError(f'the tokenizer of {self.source} has neither a BOS nor an EOS token to '
                    'start a text with')

  @property
  def vocab_size(self) -> int:
    """The number of ids, added tokens included."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  def files(self) -> dict[str, dict]:
    """{file name: JSON content} of tokenizer.json and tokenizer_config.json (the special
    tokens, whether BOS is added, the chat template), which `from_directory` reads back to
    the same tokenizer."""
    settings = {name: token for name, token in self.special.items() if token is not None}
    settings['add_bos_token'] = self.adds_bos
    if self.chat_template is not None:
      settings['chat_template'] = self.chat_template
    return {'tokenizer.json': json.loads(self.backend.to_str()),
            'tokenizer_config.json': settings}

  def save(self, directory: str) -> None:
    """Writes `files()` into `directory`."""
    os.makedirs(directory, exist_ok=True)
    for name, content in self.files().items():
      with open(os.path.join(directory, name), 'w') as f:
        json.dump(content, f, indent=1)

  @property
  def adds_bos(self) -> bool:
    """Whether `encode` puts BOS first."""
    bos = self.token_id('bos_token')
    return bos is not None and self.encode('')[:1] == [bos]

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = False) -> str:
    """`messages` ([{'role': ..., 'content': ...}, ...]) rendered by the model's chat template,
    with the assistant's opening appended if `add_generation_prompt`."""
    if self.chat_template is None:
      raise UserError(f'{self.source} has no chat template')
    try:
      return _compile(self.chat_template).render(
          messages=[dict(m) for m in messages], tools=None, documents=None,
          add_generation_prompt=add_generation_prompt,
          **{name: token for name, token in self.special.items() if token is not None})
    except jinja2.TemplateError as e:
      raise UserError(f'the chat template of {self.source} cannot be rendered: '
                      f'{type(e).__name__}: {e}') from None


def characters(alphabet: str) -> Tokenizer:
  """A character-level tokenizer: ids 0-3 are <pad>, <s> (BOS, put first by `encode`), </s>
  (EOS) and <unk>, then one id per character of `alphabet`, in its order. The built-in text
  suite's decoder reads its tasks through it: a sum or a reversal is then a rule over single
  tokens, which a model of a few million parameters can learn."""
  if len(set(alphabet)) != len(alphabet) or not alphabet:
    raise UserError(f'the alphabet {alphabet!r} must be non-empty, each character once')
  special = {'pad_token': '<pad>', 'bos_token': '<s>', 'eos_token': '</s>',
             'unk_token': '<unk>'}
  vocab = {token: i for i, token in enumerate(list(special.values()) + list(alphabet))}
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token='<unk>'))
  backend.decoder = decoders.Fuse()
  backend.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True)
                              for t in special.values()])
  backend.post_processor = _bos_eos_processor(backend, special, True, False, 'characters')
  return Tokenizer(backend, special, None, f'characters({alphabet!r})')


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(f'{path} is not valid JSON ({e})') from None


def _token_content(value: Any) -> str | None:
  """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
  return value.get('content') if isinstance(value, dict) else value


def _directory_chat_template(directory: str, settings: Mapping[str, Any]) -> str | None:
  """chat_template.jinja if the directory has one (as transformers writes it), else the
  template in tokenizer_config.json (a string, or a list of named ones: 'default')."""
  jinja_file = os.path.join(directory, 'chat_template.jinja')
  if os.path.exists(jinja_file):
    with open(jinja_file) as f:
      return f.read()
  template = settings.get('chat_template')
  if isinstance(template, list):
    named = {t.get('name'): t.get('template') for t in template}
    template = named.get('default')
  return template


def _gguf_pre_tokenizer(name: str | None, source: str) -> pre_tokenizers.PreTokenizer:
  """The splits `tokenizer.ggml.pre` names, then the bytes spelled in GPT-2's alphabet."""
  if name not in PRE_TOKENIZERS:
    raise UserError(f'{source}: tokenizer.ggml.pre {name!r} is not known here; known: '
                    f'{sorted(PRE_TOKENIZERS)}')
  splits = [pre_tokenizers.Split(tokenizers.Regex(pattern), behavior='isolated')
            for pattern in PRE_TOKENIZERS[name]]
  return pre_tokenizers.Sequence(
      splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _add_gguf_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str],
                     token_types: Sequence[int]) -> None:
  """Control tokens as special tokens and user-defined ones as added tokens, so that text
  holding them keeps them whole, as llama.cpp does."""
  control = [t for t, kind in zip(tokens, token_types) if kind == gguf.TokenType.CONTROL]
  user = [t for t, kind in zip(tokens, token_types) if kind == gguf.TokenType.USER_DEFINED]
  backend.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True)
                              for t in control])
  backend.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False) for t in user])


def _gguf_token(metadata: Mapping[str, Any], tokens: Sequence[str], name: str,
                source: str) -> str | None:
  """The text of a special token from its id in the metadata."""
  key = {'bos_token': 'bos_token_id', 'eos_token': 'eos_token_id',
         'unk_token': 'unknown_token_id', 'pad_token': 'padding_token_id'}[name]
  token_id = metadata.get(f'tokenizer.ggml.{key}')
  if token_id is None:
    return None
  if not 0 <= token_id < len(tokens):
    raise UserError(f'{source}: tokenizer.ggml.{key} is {token_id}, outside the vocabulary of '
                    f'{len(tokens)} tokens')
  return tokens[token_id]


def _bos_eos_processor(backend: tokenizers.Tokenizer, special: Mapping[str, str | None],
                       add_bos: bool, add_eos: bool, source: str) -> processors.PostProcessor:
  """Adds BOS before and/or EOS after each sequence, as the model's files ask."""
  ends = {}
  for role, wanted in (('bos_token', add_bos), ('eos_token', add_eos)):
    if wanted:
      if special[role] is None or backend.token_to_id(special[role]) is None:
        raise UserError(f'{source} asks for {role} to be added but defines no such token')
      ends[role] = special[role]
  bos = f'{ends["bos_token"]}:0 ' if 'bos_token' in ends else ''
  eos = f' {ends["eos_token"]}:0' if 'eos_token' in ends else ''
  bos_b = f' {ends["bos_token"]}:1' if 'bos_token' in ends else ''
  eos_b = f' {ends["eos_token"]}:1' if 'eos_token' in ends else ''
  return processors.TemplateProcessing(
      single=f'{bos}$A:0{eos}', pair=f'{bos}$A:0{eos}{bos_b} $B:1{eos_b}',
      special_tokens=[(t, backend.token_to_id(t)) for t in ends.values()])


def _raise_exception(message: str):
  raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
  # jinja2's own tojson escapes HTML characters, which a prompt must keep as they are.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
  """The template in a sandbox that refuses access to Python internals."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
  return env.from_string(template)
