"""Tiny GGUF files for the tests, written with gguf's own writer.

`llama_tensors` draws a small random decoder in Hugging Face's layout; `write` stores it as
llama.cpp's converter would (its tensor names, Q/K rows permuted for llama), each tensor in the
type asked for, with a byte-level BPE tokenizer in the metadata.
"""

import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

import gguf

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 256, 4, 2, 512, 2
HEAD_DIM = HIDDEN // HEADS

# Byte-level BPE: control tokens, the 256 byte symbols, merged tokens, one user-defined token.
CONTROL = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
MERGES = ('h e', 'l l', 'he ll', 'hell o', 'Ġ w', 'o r', 'Ġw or', 'l d', 'Ġwor ld', 'Ġ t',
          'Ġt he', '1 2', "' s", 'Ġ Ġ', 'Ċ Ċ', 'i n', 'Ġ in', 'Ã ©')
USER_DEFINED = ('<think>',)
TOKENS = (list(CONTROL) + list(bytes_to_unicode().values()) +
          [m.replace(' ', '') for m in MERGES] + list(USER_DEFINED))
TOKEN_TYPES = ([gguf.TokenType.CONTROL] * len(CONTROL) +
               [gguf.TokenType.NORMAL] * (len(TOKENS) - len(CONTROL) - len(USER_DEFINED)) +
               [gguf.TokenType.USER_DEFINED] * len(USER_DEFINED))
VOCAB = len(TOKENS)

_BLOCK = {'input_layernorm': 'attn_norm', 'self_attn.q_proj': 'attn_q',
          'self_attn.k_proj': 'attn_k', 'self_attn.v_proj': 'attn_v',
          'self_attn.o_proj': 'attn_output', 'self_attn.q_norm': 'attn_q_norm',
          'self_attn.k_norm': 'attn_k_norm', 'post_attention_layernorm': 'ffn_norm',
          'mlp.gate_proj': 'ffn_gate', 'mlp.up_proj': 'ffn_up', 'mlp.down_proj': 'ffn_down'}
_GLOBAL = {'model.embed_tokens.weight': 'token_embd.weight', 'model.norm.weight':
           'output_norm.weight', 'lm_head.weight': 'output.weight'}


def llama_tensors(seed: int = 0, *, arch: str = 'llama', tied: bool = False
                  ) -> dict[str, np.ndarray]:
  """{Hugging Face name: float32 array} of a random decoder of `arch` (qwen2 adds Q/K/V
  biases, qwen3 Q/K norms); no lm_head when `tied`."""
  rng = np.random.default_rng(seed)

  def draw(*shape):
    return (0.1 * rng.standard_normal(shape)).astype(np.float32)

  tensors = {'model.embed_tokens.weight': draw(VOCAB, HIDDEN),
             'model.norm.weight': 1 + draw(HIDDEN)}
  if not tied:
    tensors['lm_head.weight'] = draw(VOCAB, HIDDEN)
  for i in range(LAYERS):
    layer = {'input_layernorm.weight': 1 + draw(HIDDEN),
             'self_attn.q_proj.weight': draw(HEADS * HEAD_DIM, HIDDEN),
             'self_attn.k_proj.weight': draw(KV_HEADS * HEAD_DIM, HIDDEN),
             'self_attn.v_proj.weight': draw(KV_HEADS * HEAD_DIM, HIDDEN),
             'self_attn.o_proj.weight': draw(HIDDEN, HEADS * HEAD_DIM),
             'post_attention_layernorm.weight': 1 + draw(HIDDEN),
             'mlp.gate_proj.weight': draw(INTERMEDIATE, HIDDEN),
             'mlp.up_proj.weight': draw(INTERMEDIATE, HIDDEN),
             'mlp.down_proj.weight': draw(HIDDEN, INTERMEDIATE)}
    if arch == 'qwen2':
      layer.update({f'self_attn.{p}_proj.bias': draw(n * HEAD_DIM)
                    for p, n in (('q', HEADS), ('k', KV_HEADS), ('v', KV_HEADS))})
    if arch == 'qwen3':
      layer.update({f'self_attn.{p}_norm.weight': 1 + draw(HEAD_DIM) for p in 'qk'})
    tensors.update({f'model.layers.{i}.{name}': x for name, x in layer.items()})
  return tensors


def gguf_name(hf_name: str) -> str:
  """llama.cpp's name of a Hugging Face tensor."""
  if hf_name in _GLOBAL:
    return _GLOBAL[hf_name]
  _, _, layer, rest = hf_name.split('.', 3)
  stem, kind = rest.rsplit('.', 1)
  return f'blk.{layer}.{_BLOCK[stem]}.{kind}'


def llama_cpp_permute(x: np.ndarray, heads: int) -> np.ndarray:
  """Q/K rows in llama.cpp's order: each head's two halves interleaved row by row."""
  half = x.shape[0] // heads // 2
  return x.reshape(heads, 2, half, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def write(path, tensors: dict[str, np.ndarray], *, arch: str = 'llama',
          types: dict[str, gguf.GGMLQuantizationType] | None = None,
          raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
          extra: dict[str, np.ndarray] | None = None, pre: str = 'gpt-2', add_bos: bool = False,
          chat_template: str | None = None) -> None:
  """Writes `tensors` (Hugging Face names) as a GGUF file of `arch`: each 2-D tensor quantized
  to types[name] (F32 if not given), 1-D ones in F32, raw[name] = (bytes, type) stored as
  given, and `extra` tensors under their GGUF names."""
  types, raw = types or {}, raw or {}
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(LAYERS)
  writer.add_context_length(128)
  writer.add_embedding_length(HIDDEN)
  writer.add_feed_forward_length(INTERMEDIATE)
  writer.add_head_count(HEADS)
  writer.add_head_count_kv(KV_HEADS)
  writer.add_key_length(HEAD_DIM)
  writer.add_value_length(HEAD_DIM)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_rope_freq_base(50000.0)
  writer.add_vocab_size(VOCAB)
  writer.add_tokenizer_model('gpt2')
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(TOKENS)
  writer.add_token_types(TOKEN_TYPES)
  writer.add_token_merges(MERGES)
  writer.add_bos_token_id(TOKENS.index('<|im_start|>'))
  writer.add_eos_token_id(TOKENS.index('<|im_end|>'))
  writer.add_pad_token_id(TOKENS.index('<|endoftext|>'))
  writer.add_add_bos_token(add_bos)
  if chat_template is not None:
    writer.add_chat_template(chat_template)
  for name, x in tensors.items():
    if arch == 'llama' and ('q_proj' in name or 'k_proj' in name):
      x = llama_cpp_permute(x, HEADS if 'q_proj' in name else KV_HEADS)
    if name in raw:
      data, qtype = raw[name]
      writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    elif name in types and x.ndim == 2:
      quantized = gguf.quants.quantize(x, types[name])
      writer.add_tensor(gguf_name(name), quantized, raw_dtype=types[name])
    else:
      writer.add_tensor(gguf_name(name), x)
  for name, x in (extra or {}).items():
    writer.add_tensor(name, x)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
