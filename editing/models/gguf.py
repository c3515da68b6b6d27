"""Decoder language models from GGUF files (llama.cpp's format), through the `gguf` package.

`read(path)` gives what a Hugging Face directory holds: the config.json dict, the tensors under
Hugging Face's names in float32, and the tokenizer the file's metadata describes;
`load_gguf(path)` gives the decoder's (config, params, tokenizer). Architectures: llama
(SmolLM2 is one), qwen2 and qwen3; any other is refused by name. Tensors are dequantized one at
a time, when asked for, with gguf's own numpy dequantizers, from the types in `READABLE`; a
tensor of any other type is refused, with its name and type, when the file is opened.

llama.cpp's converter reorders the rows of a llama model's Q and K projections (weights and
biases) within each head, from Hugging Face's rotate-half RoPE layout to the interleaved pairs
its own RoPE kernel reads; `read` puts them back. Qwen models are stored unpermuted (llama.cpp
rotates them in the rotate-half layout).
"""

import collections.abc
import dataclasses
import re
from typing import Any

import gguf
import numpy as np

from editing.errors import UserError
from editing.models import tokenizer as tokenizer_lib
from editing.models.decoder_config import DecoderConfig
from third_party import hf_decoder

_Q = gguf.GGMLQuantizationType
READABLE = frozenset((_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
                      _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K))


@dataclasses.dataclass(frozen=True)
class Architecture:
  """How one of llama.cpp's architectures maps onto a transformers model class."""

  model_type: str
  hf_class: str
  qk_permuted: bool  # Q/K rows stored in llama.cpp's interleaved RoPE order
  extra_config: tuple[tuple[str, Any], ...]  # config.json fields the metadata leaves implicit


ARCHITECTURES = {
    'llama': Architecture('llama', 'LlamaForCausalLM', qk_permuted=True,
                          extra_config=(('attention_bias', False), ('mlp_bias', False))),
    'qwen2': Architecture('qwen2', 'Qwen2ForCausalLM', qk_permuted=False, extra_config=()),
    'qwen3': Architecture('qwen3', 'Qwen3ForCausalLM', qk_permuted=False,
                          extra_config=(('attention_bias', False),)),
}

# {architecture}.<key> -> config.json field, for the fields every architecture states.
_REQUIRED = {
    'embedding_length': 'hidden_size',
    'feed_forward_length': 'intermediate_size',
    'block_count': 'num_hidden_layers',
    'attention.head_count': 'num_attention_heads',
    'attention.layer_norm_rms_epsilon': 'rms_norm_eps',
    'context_length': 'max_position_embeddings',
}
# llama.cpp's defaults for the keys a file may leave out.
_DEFAULT_ROPE_THETA = 10000.0

_GLOBAL_TENSORS = {
    'token_embd': 'model.embed_tokens',
    'output_norm': 'model.norm',
    'output': 'lm_head',
}
_BLOCK_TENSORS = {
    'attn_norm': 'input_layernorm',
    'attn_q': 'self_attn.q_proj',
    'attn_k': 'self_attn.k_proj',
    'attn_v': 'self_attn.v_proj',
    'attn_output': 'self_attn.o_proj',
    'attn_q_norm': 'self_attn.q_norm',
    'attn_k_norm': 'self_attn.k_norm',
    'ffn_norm': 'post_attention_layernorm',
    'ffn_gate': 'mlp.gate_proj',
    'ffn_up': 'mlp.up_proj',
    'ffn_down': 'mlp.down_proj',
}
_BLOCK_NAME = re.compile(r'blk\.(\d+)\.(\w+)\.(weight|bias)')


class File(collections.abc.Mapping):
  """An open GGUF file: `config` (config.json as a dict), `tokenizer`, and its tensors as a
  mapping {Hugging Face name: float32 array} that dequantizes a tensor each time it is read
  (no lm_head.weight when the embedding is tied). Every name, type and metadata key is checked
  when it is opened."""

  def __init__(self, path: str):
    self.path = path
    reader = _open(path)
    metadata = _metadata(reader, path)
    self.architecture = _architecture(metadata, path)
    self.config = hf_config(metadata, {t.name for t in reader.tensors}, path)
    _check_types(reader, path)
    self._tensors = {hf_name(t.name, path): t for t in reader.tensors}
    self.tokenizer = tokenizer_lib.Tokenizer.from_gguf(metadata, path)

  def __getitem__(self, name: str) -> np.ndarray:
    return _dequantize(self._tensors[name], self.architecture, self.config, self.path)

  def __contains__(self, name: object) -> bool:  # without dequantizing, as Mapping's would
    return name in self._tensors

  def __iter__(self):
    return iter(self._tensors)

  def __len__(self) -> int:
    return len(self._tensors)

  def shape(self, name: str) -> tuple[int, ...]:
    """A tensor's shape in numpy order, from the file's index alone."""
    return tuple(int(n) for n in reversed(self._tensors[name].shape))


def read(path: str) -> tuple[dict, dict[str, np.ndarray], tokenizer_lib.Tokenizer]:
  """(config, tensors, tokenizer) of the GGUF file at `path`: config.json as a dict, every
  tensor dequantized to float32 under its Hugging Face name, and the tokenizer."""
  file = File(path)
  return file.config, dict(file.items()), file.tokenizer


def load_gguf(path: str, *, dtype: Any = np.float32
              ) -> tuple[DecoderConfig, dict, tokenizer_lib.Tokenizer]:
  """(config, params, tokenizer) of the decoder in the GGUF file at `path`, params in `dtype`;
  each tensor is dequantized only as it is converted, so one float32 copy of the largest
  tensor is the most held beside the params."""
  file = File(path)
  config = DecoderConfig.from_hf(file.config)
  params = hf_decoder.to_params(_Lazy(file), config, dtype=dtype)
  return config, params, file.tokenizer


class _Lazy(collections.abc.Mapping):
  """A File's tensors as hf_decoder.to_params reads them: each value has the tensor's shape
  and is dequantized when converted to an array."""

  def __init__(self, file: File):
    self._file = file

  def __getitem__(self, name: str) -> '_LazyTensor':
    if name not in self._file:
      raise KeyError(name)
    return _LazyTensor(self._file, name)

  def __iter__(self):
    return iter(self._file)

  def __len__(self) -> int:
    return len(self._file)


class _LazyTensor:
  """One tensor of a File: its shape from the index, its values on np.asarray."""

  def __init__(self, file: File, name: str):
    self._file, self._name = file, name
    self.shape = file.shape(name)

  def __array__(self, dtype=None, copy=None):
    del copy  # always a fresh array
    x = self._file[self._name]
    return x if dtype is None else x.astype(dtype)


def _open(path: str) -> gguf.GGUFReader:
  """The file's reader; a file gguf cannot parse (truncated, corrupt, not GGUF) is one error."""
  try:
    return gguf.GGUFReader(path)
  except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
    raise UserError(f'{path} is not a readable GGUF file, truncated or corrupt '
                    f'({type(e).__name__}: {e})') from None


def _metadata(reader: gguf.GGUFReader, path: str) -> dict[str, Any]:
  """{key: value} of the file's metadata, strings and arrays as Python values."""
  try:
    return {key: field.contents() for key, field in reader.fields.items()}
  except (ValueError, IndexError, UnicodeDecodeError) as e:
    raise UserError(f'{path} has metadata that cannot be read ({type(e).__name__}: {e})') \
        from None


def _architecture(metadata: dict[str, Any], path: str) -> Architecture:
  name = metadata.get('general.architecture')
  if name not in ARCHITECTURES:
    raise UserError(f'{path} holds a {name!r} model; GGUF files are read for the architectures '
                    f'{sorted(ARCHITECTURES)}')
  return ARCHITECTURES[name]


def hf_config(metadata: dict[str, Any], tensor_names: set[str], path: str) -> dict:
  """config.json of the model the metadata describes (`tensor_names` tell whether the output
  projection is tied to the embedding)."""
  name = metadata['general.architecture']
  arch = ARCHITECTURES[name]

  def key(suffix: str, default: Any = None) -> Any:
    value = metadata.get(f'{name}.{suffix}', default)
    if value is None:
      raise UserError(f'{path} lacks the metadata key {name}.{suffix}')
    return value

  config = {'architectures': [arch.hf_class], 'model_type': arch.model_type,
            'hidden_act': 'silu'}
  config.update({field: key(suffix) for suffix, field in _REQUIRED.items()})
  heads = config['num_attention_heads']
  config['num_key_value_heads'] = key('attention.head_count_kv', heads)
  config['head_dim'] = key('attention.key_length', config['hidden_size'] // heads)
  config['rope_theta'] = float(key('rope.freq_base', _DEFAULT_ROPE_THETA))
  config['rope_scaling'] = _rope_scaling(metadata, name, tensor_names, path)
  config['vocab_size'] = key('vocab_size', len(metadata.get('tokenizer.ggml.tokens', ())) or None)
  config['tie_word_embeddings'] = 'output.weight' not in tensor_names
  for field, gguf_key in (('bos_token_id', 'bos_token_id'), ('eos_token_id', 'eos_token_id'),
                          ('pad_token_id', 'padding_token_id')):
    if f'tokenizer.ggml.{gguf_key}' in metadata:
      config[field] = metadata[f'tokenizer.ggml.{gguf_key}']
  config.update(arch.extra_config)
  return config


def _rope_scaling(metadata: dict[str, Any], name: str, tensor_names: set[str],
                  path: str) -> dict | None:
  """config.json's rope_scaling: None, or linear scaling by the file's factor."""
  if 'rope_freqs.weight' in tensor_names:
    # Llama 3.1-style scaling, which the converter bakes into per-frequency factors whose
    # parameters the file does not keep.
    raise UserError(f'{path} scales RoPE by per-frequency factors (rope_freqs.weight), which '
                    'are not read here')
  kind = metadata.get(f'{name}.rope.scaling.type', 'none')
  if kind == 'none':
    return None
  if kind != 'linear':
    raise UserError(f'{path}: {name}.rope.scaling.type {kind!r} is not read here (only '
                    '"linear")')
  return {'rope_type': 'linear', 'factor': float(metadata[f'{name}.rope.scaling.factor'])}


def hf_name(gguf_name: str, path: str) -> str:
  """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` ->
  `model.layers.3.self_attn.q_proj.weight`); a tensor of no known role is refused by name."""
  stem, _, kind = gguf_name.rpartition('.')
  if stem in _GLOBAL_TENSORS and kind == 'weight':
    return f'{_GLOBAL_TENSORS[stem]}.weight'
  match = _BLOCK_NAME.fullmatch(gguf_name)
  if match and match[2] in _BLOCK_TENSORS:
    return f'model.layers.{match[1]}.{_BLOCK_TENSORS[match[2]]}.{match[3]}'
  raise UserError(f'{path} holds the tensor {gguf_name}, which no decoder weight maps to')


def _check_types(reader: gguf.GGUFReader, path: str) -> None:
  for t in reader.tensors:
    if t.tensor_type not in READABLE:
      raise UserError(f'{path}: tensor {t.name} is stored as {t.tensor_type.name}, which is not '
                      f'read here; readable: {", ".join(sorted(q.name for q in READABLE))}')


def _dequantize(t: Any, arch: Architecture, config: dict, path: str) -> np.ndarray:
  """One tensor in float32, in Hugging Face's layout (numpy order: rows are output features)."""
  values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
  shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions fastest first
  if values.shape != shape:
    raise UserError(f'{path}: tensor {t.name} dequantizes to {values.shape}, not {shape}')
  if arch.qk_permuted and re.fullmatch(r'blk\.\d+\.attn_[qk]\.(weight|bias)', t.name):
    heads = config['num_attention_heads' if '.attn_q.' in t.name else 'num_key_value_heads']
    values = unpermute_qk(values, heads, t.name, path)
  return values


def unpermute_qk(x: np.ndarray, heads: int, name: str = 'tensor', path: str = '') -> np.ndarray:
  """Undoes llama.cpp's RoPE reordering of a Q or K projection's rows (its first axis).

  Within each head llama.cpp stores rows as interleaved pairs (0, h/2, 1, h/2 + 1, ...) where
  Hugging Face keeps the two halves apart (0, 1, ..., h/2 - 1 | h/2, ...), h the head size.
  """
  if x.shape[0] % (2 * heads):
    raise UserError(f'{path}: tensor {name} has {x.shape[0]} rows, which {heads} heads of an '
                    'even size cannot split')
  half = x.shape[0] // heads // 2
  return x.reshape(heads, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
