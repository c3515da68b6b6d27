"""editing.models.gguf: tiny GGUF files written with gguf's own writer, read back against their
source tensors, transformers' own GGUF loading, and transformers' dequantizers."""

import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.integrations.gguf import dequant as hf_dequant

from editing.errors import UserError
from editing.models import decoder
from editing.models import gguf as gguf_lib
from tests import tiny_gguf

Q = gguf.GGMLQuantizationType


def _row_bound(x: np.ndarray, qtype: Q) -> np.ndarray:
  """The largest error a round trip through `qtype` may make in each row of `x` (every
  quantization block lies within a row, so a row's spread bounds its blocks'): half a step of
  rounding (a whole step where the symmetric types clip their top level), and the float16
  rounding of the stored scale (and minimum)."""
  amax = np.abs(x).max(axis=-1, keepdims=True)
  spread = x.max(axis=-1, keepdims=True) - x.min(axis=-1, keepdims=True)
  half = 2.0**-11  # float16's relative rounding error
  return {
      Q.F16: np.abs(x) * half,
      Q.BF16: np.abs(x) * 2.0**-8,
      Q.Q8_0: amax * (0.5 / 127 + half),
      Q.Q4_0: amax / 8 * (1 + 8 * half),
      Q.Q5_0: amax / 16 * (1 + 16 * half),
      Q.Q4_1: spread / 15 * (0.5 + 15 * half) + amax * half,
      Q.Q5_1: spread / 31 * (0.5 + 31 * half) + amax * half,
  }[qtype]


def test_float32_tensors_are_exact_with_the_qk_permutation_undone(tmp_path):
  source = tiny_gguf.llama_tensors()
  tiny_gguf.write(tmp_path / 'm.gguf', source)
  config, tensors, _ = gguf_lib.read(str(tmp_path / 'm.gguf'))
  assert sorted(tensors) == sorted(source)
  for name, x in source.items():
    assert tensors[name].dtype == np.float32
    np.testing.assert_array_equal(tensors[name], x, err_msg=name)
  assert config['tie_word_embeddings'] is False
  assert (config['num_attention_heads'], config['num_key_value_heads'], config['head_dim']) == (
      tiny_gguf.HEADS, tiny_gguf.KV_HEADS, tiny_gguf.HEAD_DIM)


def test_tied_embedding_has_no_lm_head(tmp_path):
  tiny_gguf.write(tmp_path / 'm.gguf', tiny_gguf.llama_tensors(tied=True))
  config, tensors, _ = gguf_lib.read(str(tmp_path / 'm.gguf'))
  assert config['tie_word_embeddings'] is True
  assert 'lm_head.weight' not in tensors


@pytest.mark.parametrize('qtype', [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1],
                         ids=lambda q: q.name)
def test_quantized_tensors_within_the_types_error_bound(tmp_path, qtype):
  source = tiny_gguf.llama_tensors()
  tiny_gguf.write(tmp_path / 'm.gguf', source, types={name: qtype for name in source})
  _, tensors, _ = gguf_lib.read(str(tmp_path / 'm.gguf'))
  for name, x in source.items():
    error = np.abs(tensors[name] - x)
    if x.ndim == 1:  # vectors stay float32
      np.testing.assert_array_equal(error, 0, err_msg=name)
    else:
      # float16's subnormal spacing bounds the error of values too small for its relative one
      assert np.all(error <= _row_bound(x, qtype) + 2.0**-24), (name, float(error.max()))
      assert error.max() > 0, name  # it was quantized


def _random_blocks(rng: np.random.Generator, qtype: Q, rows: int, columns: int) -> np.ndarray:
  """Random bytes of `qtype` blocks whose float16 scales are finite and moderate."""
  block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
  blocks = rng.integers(0, 256, (rows * columns // block_size, type_size), dtype=np.uint8)
  scale_offsets = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                   Q.Q6_K: (208,)}[qtype]
  for offset in scale_offsets:
    scales = rng.uniform(1e-3, 1e-2, len(blocks)).astype(np.float16)
    blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
  return blocks.reshape(rows, -1)


@pytest.mark.parametrize('qtype', [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_match_transformers_dequantizer(tmp_path, qtype):
  """K-quant blocks (written raw: gguf has no K-quantizer) read as transformers' own torch
  dequantizer reads them, the Q projection's rows put back in Hugging Face's order."""
  rng = np.random.default_rng(int(qtype))
  source = tiny_gguf.llama_tensors()
  gate, query = 'model.layers.0.mlp.gate_proj.weight', 'model.layers.1.self_attn.q_proj.weight'
  raw = {name: _random_blocks(rng, qtype, *source[name].shape) for name in (gate, query)}
  tiny_gguf.write(tmp_path / 'm.gguf', source, raw={n: (b, qtype) for n, b in raw.items()})
  _, tensors, _ = gguf_lib.read(str(tmp_path / 'm.gguf'))
  for name, blocks in raw.items():
    expected = hf_dequant.dequantize(torch.from_numpy(blocks.reshape(-1)), int(qtype)).numpy()
    expected = expected.reshape(source[name].shape)
    ours = tensors[name]
    if name == query:  # back to the order the file stores
      ours = tiny_gguf.llama_cpp_permute(ours, tiny_gguf.HEADS)
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-7, err_msg=name)


def test_qwen3_norms_unpermuted_and_logits_of_its_source(tmp_path):
  """Qwen3 (per-head Q/K norms, rows stored unpermuted): the tensors read back exactly, and
  the decoder `load_gguf` builds computes the logits of transformers' Qwen3 holding the source
  tensors (transformers' own GGUF loading does not read Qwen3's head size)."""
  source = tiny_gguf.llama_tensors(arch='qwen3', tied=True)
  tiny_gguf.write(tmp_path / 'm.gguf', source, arch='qwen3')
  hf_config, tensors, _ = gguf_lib.read(str(tmp_path / 'm.gguf'))
  assert hf_config['model_type'] == 'qwen3' and hf_config['head_dim'] == tiny_gguf.HEAD_DIM
  assert sorted(tensors) == sorted(source)
  for name, x in source.items():
    np.testing.assert_array_equal(tensors[name], x, err_msg=name)

  config, params, tokenizer = gguf_lib.load_gguf(str(tmp_path / 'm.gguf'))
  tokens = np.array([tokenizer.encode("the hello world, it's 12")])
  logits, _ = decoder.Decoder(config).apply({'params': params}, tokens,
                                            np.arange(tokens.shape[1])[None],
                                            np.ones(tokens.shape, bool))
  model = Qwen3ForCausalLM(Qwen3Config(
      vocab_size=tiny_gguf.VOCAB, hidden_size=tiny_gguf.HIDDEN,
      intermediate_size=tiny_gguf.INTERMEDIATE, num_hidden_layers=tiny_gguf.LAYERS,
      num_attention_heads=tiny_gguf.HEADS, num_key_value_heads=tiny_gguf.KV_HEADS,
      head_dim=tiny_gguf.HEAD_DIM, rms_norm_eps=1e-5, tie_word_embeddings=True,
      rope_parameters={'rope_type': 'default', 'rope_theta': 50000.0}))
  missing, unexpected = model.load_state_dict(
      {n: torch.from_numpy(x) for n, x in source.items()}, strict=False)
  assert (missing, unexpected) == (['lm_head.weight'], [])  # tied to the embedding
  with torch.no_grad():
    expected = model(torch.from_numpy(tokens).long()).logits.numpy()
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-4, atol=1e-5)


def test_load_gguf_dequantizes_each_tensor_once(tmp_path, monkeypatch):
  source = tiny_gguf.llama_tensors()
  tiny_gguf.write(tmp_path / 'm.gguf', source, types={name: Q.Q8_0 for name in source})
  calls = []
  dequantize = gguf.quants.dequantize
  monkeypatch.setattr(gguf.quants, 'dequantize',
                      lambda data, qtype: calls.append(qtype) or dequantize(data, qtype))
  gguf_lib.load_gguf(str(tmp_path / 'm.gguf'))
  assert len(calls) == len(source)


def test_unsupported_type_is_refused_by_tensor_and_type(tmp_path):
  source = tiny_gguf.llama_tensors()
  name = 'model.layers.1.mlp.down_proj.weight'
  blocks = np.zeros((tiny_gguf.HIDDEN, tiny_gguf.INTERMEDIATE // 32 * 18), np.uint8)
  tiny_gguf.write(tmp_path / 'm.gguf', source, raw={name: (blocks, Q.IQ4_NL)})
  with pytest.raises(UserError, match=r'm\.gguf: tensor blk\.1\.ffn_down\.weight is stored as '
                                      r'IQ4_NL'):
    gguf_lib.read(str(tmp_path / 'm.gguf'))


def test_a_vocabulary_that_does_not_match_the_embedding_is_named(tmp_path):
  """One embedding row more than the file's tokenizer has tokens."""
  source = tiny_gguf.llama_tensors(tied=True)
  embedding = source['model.embed_tokens.weight']
  source['model.embed_tokens.weight'] = np.concatenate([embedding, embedding[:1]])
  tiny_gguf.write(tmp_path / 'm.gguf', source)
  with pytest.raises(UserError, match=rf'model\.embed_tokens\.weight has shape '
                                      rf'\({tiny_gguf.VOCAB + 1}, {tiny_gguf.HIDDEN}\), the model '
                                      rf'\({tiny_gguf.VOCAB}, {tiny_gguf.HIDDEN}\)'):
    gguf_lib.load_gguf(str(tmp_path / 'm.gguf'))
  assert os.listdir(tmp_path) == ['m.gguf']


@pytest.mark.parametrize('keep', [0.0001, 0.002, 0.3, 0.9999])
def test_truncated_file_is_refused_naming_it(tmp_path, keep):
  """Cut in the header, in the metadata, in the tensor data, and by a few bytes."""
  tiny_gguf.write(tmp_path / 'm.gguf', tiny_gguf.llama_tensors())
  data = (tmp_path / 'm.gguf').read_bytes()
  (tmp_path / 'cut.gguf').write_bytes(data[:int(len(data) * keep)])
  with pytest.raises(UserError, match=r'cut\.gguf is not a readable GGUF file') as error:
    gguf_lib.read(str(tmp_path / 'cut.gguf'))
  assert '\n' not in str(error.value)


def test_file_that_is_not_gguf_is_refused_naming_it(tmp_path):
  (tmp_path / 'model.safetensors').write_bytes(b'\x08\x00\x00\x00\x00\x00\x00\x00{}      ')
  with pytest.raises(UserError, match=r'model\.safetensors is not a readable GGUF file'):
    gguf_lib.read(str(tmp_path / 'model.safetensors'))


def test_other_architecture_is_refused_by_name(tmp_path):
  tiny_gguf.write(tmp_path / 'm.gguf', tiny_gguf.llama_tensors(), arch='gemma2')
  with pytest.raises(UserError, match=r"holds a 'gemma2' model"):
    gguf_lib.read(str(tmp_path / 'm.gguf'))


def test_tensor_of_no_known_role_is_refused_by_name(tmp_path):
  experts = np.zeros((4, tiny_gguf.INTERMEDIATE, tiny_gguf.HIDDEN), np.float32)
  tiny_gguf.write(tmp_path / 'm.gguf', tiny_gguf.llama_tensors(),
                  extra={'blk.0.ffn_gate_exps.weight': experts})
  with pytest.raises(UserError, match=r'm\.gguf holds the tensor blk\.0\.ffn_gate_exps\.weight'):
    gguf_lib.read(str(tmp_path / 'm.gguf'))


@pytest.mark.parametrize('arch', ['llama', 'qwen2'])
def test_tensors_config_and_logits_match_transformers_gguf_loading(tmp_path, arch):
  """What transformers loads from the same file: its state dict, its config and, for the
  decoder `load_gguf` builds, its logits."""
  source = tiny_gguf.llama_tensors(arch=arch, tied=arch == 'llama')
  tiny_gguf.write(tmp_path / 'm.gguf', source, arch=arch,
                  types={name: Q.Q4_1 if 'mlp' in name else Q.Q8_0 for name in source})
  model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file='m.gguf', dtype=torch.float32)

  hf_config, tensors, _ = gguf_lib.read(str(tmp_path / 'm.gguf'))
  theirs = model.state_dict()
  assert sorted(tensors) == sorted(set(theirs) - ({'lm_head.weight'} if arch == 'llama' else set()))
  for name, x in tensors.items():
    np.testing.assert_array_equal(x, theirs[name].numpy(), err_msg=name)
  their_config = model.config.to_dict()
  # transformers 5 keeps the RoPE base under rope_parameters, and Qwen2Config has no head_dim.
  assert hf_config['rope_theta'] == their_config['rope_parameters']['rope_theta']
  assert hf_config['architectures'] == [type(model).__name__]
  for field, value in hf_config.items():
    if field not in ('architectures', 'rope_theta', 'rope_scaling', 'head_dim'):
      assert their_config[field] == value, field

  config, params, tokenizer = gguf_lib.load_gguf(str(tmp_path / 'm.gguf'))
  tokens = np.array([tokenizer.encode("hello world, the 12 cats' toys in the hello world")])
  positions = np.arange(tokens.shape[1])[None]
  logits, _ = decoder.Decoder(config).apply({'params': params}, tokens, positions,
                                            np.ones(tokens.shape, bool))
  with torch.no_grad():
    expected = model(torch.from_numpy(tokens).long()).logits.numpy()
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-4, atol=1e-5)
