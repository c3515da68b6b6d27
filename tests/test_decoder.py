"""The decoder against transformers' PyTorch models: a tiny random model per family, saved by
save_pretrained and read by `hf_decoder.load`; logits, padding, export, config refusals."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from editing import sharding
from editing import tree as tree_lib
from editing.errors import UserError
from editing.models import decoder
from editing.models.decoder_config import DecoderConfig
from editing.regimes import attention_only
from merging import ops
from tests.test_hf import random_model
from third_party import hf_decoder

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, vocab_size=128, head_dim=8)
LENGTH = 16
WINDOW = 5  # shorter than LENGTH, so that sliding layers differ from global ones
# family: (config class, model class, what the tiny config sets beyond SIZES)
FAMILIES = {
    'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_parameters=dict(rope_type='llama3', rope_theta=10000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8))),
    'mistral': (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=WINDOW)),
    'mixtral': (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),
    'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    'qwen3': (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    # Unnormalised routing weights, where Mixtral's are renormalised.
    'qwen2_moe': (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, norm_topk_prob=True)),
    'qwen3_moe': (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       norm_topk_prob=False)),
    'gemma2': (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=1.0,
        final_logit_softcapping=3.0)),
    'gemma3': (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        sliding_window=WINDOW, query_pre_attn_scalar=16,
        layer_types=['sliding_attention', 'full_attention'])),
}
# Largest |ours − transformers'| of float32 logits of magnitude ~1 (measured: ≤ 1.3e-6).
ATOL = 1e-5


def tiny(family: str):
  """A random transformers causal LM of `family`, eager attention, float32."""
  config_class, model_class, extra = FAMILIES[family]
  config = config_class(**SIZES, **extra, attn_implementation='eager')
  return random_model(model_class, config)


@pytest.fixture(scope='module', name='saved')
def saved_fixture(tmp_path_factory):
  """family -> (transformers model, its directory, our config, our params), made once."""
  made = {}

  def get(family):
    if family not in made:
      model = tiny(family)
      directory = tmp_path_factory.mktemp(family)
      model.save_pretrained(directory)
      made[family] = (model, directory, *hf_decoder.load(str(directory)))
    return made[family]

  return get


_FORWARDS = {}


def ours(config, params, tokens, mask):
  """Our float32 logits, positions counted over each row's real tokens; one compile per
  config."""
  if config not in _FORWARDS:
    _FORWARDS[config] = jax.jit(lambda p, t, pos, m: decoder.Decoder(config).apply(
        {'params': p}, t, pos, m)[0])
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with jax.default_matmul_precision('highest'):
    return np.asarray(_FORWARDS[config](params, tokens, positions, mask))


def theirs(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(tokens)).long()).logits.numpy()


def random_tokens(rows=2, length=LENGTH, seed=0):
  return np.random.default_rng(seed).integers(0, SIZES['vocab_size'], (rows, length))


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_logits_match_transformers(saved, family):
  model, _, config, params = saved(family)
  tokens = random_tokens()
  expected = theirs(model, tokens)
  got = ours(config, params, tokens, np.ones_like(tokens, bool))
  np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_padded_batch_gives_each_sequence_its_own_logits(saved, family):
  """Row 0 left-padded, row 1 right-padded: the real tokens' logits are those of each
  sequence run alone in transformers."""
  model, _, config, params = saved(family)
  short, long = random_tokens(1, 11, seed=1)[0], random_tokens(1, 13, seed=2)[0]
  tokens = np.zeros((2, LENGTH), np.int64)
  mask = np.zeros((2, LENGTH), bool)
  tokens[0, -len(short):], mask[0, -len(short):] = short, True
  tokens[1, :len(long)], mask[1, :len(long)] = long, True
  got = ours(config, params, tokens, mask)
  np.testing.assert_allclose(got[0, -len(short):], theirs(model, short[None])[0], atol=ATOL)
  np.testing.assert_allclose(got[1, :len(long)], theirs(model, long[None])[0], atol=ATOL)


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_export_reloads_in_transformers_with_the_same_logits(saved, tmp_path, family):
  model, directory, config, params = saved(family)
  hf_decoder.export(params, config, str(tmp_path / 'out'), shard_bytes=20_000)
  reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / 'out', attn_implementation='eager', output_loading_info=True)
  assert not any(info.values()), info
  tokens = random_tokens()
  np.testing.assert_array_equal(theirs(reloaded.eval(), tokens), theirs(model, tokens))
  with open(directory / 'config.json') as f:
    assert DecoderConfig.from_hf(json.load(f)) == config


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_config_round_trips_through_to_hf(family):
  config_class, _, extra = FAMILIES[family]
  given = config_class(**SIZES, **extra).to_dict()
  config = DecoderConfig.from_hf(given)
  assert DecoderConfig.from_hf(config.to_hf()) == config
  assert config.num_layers == 2 and config.head_dim == 8 and config.num_kv_heads == 2


def test_older_config_forms_read_as_transformers_reads_them():
  """rope_theta / rope_scaling (transformers 4) and Gemma 3's rope_local_base_freq and
  sliding_window_pattern give what transformers 5 makes of them."""
  llama = dict(SIZES, model_type='llama', rope_theta=5e5, torch_dtype='bfloat16',
               rope_scaling=dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192))
  gemma3 = dict(SIZES, model_type='gemma3_text', num_hidden_layers=4, rope_theta=2e5,
                rope_local_base_freq=3e3, sliding_window_pattern=2, sliding_window=WINDOW)
  for given, config_class in [(llama, transformers.LlamaConfig),
                              (gemma3, transformers.Gemma3TextConfig)]:
    fields = {k: v for k, v in given.items() if k != 'model_type'}
    expected = DecoderConfig.from_hf(config_class(**fields).to_dict())
    assert DecoderConfig.from_hf(given) == expected
  assert expected.layer_types == ('sliding_attention', 'full_attention') * 2
  assert (expected.rope.theta, expected.local_rope.theta) == (2e5, 3e3)


def test_unknown_field_architecture_and_model_type_are_refused_by_name():
  given = transformers.LlamaConfig(**SIZES).to_dict()
  with pytest.raises(UserError, match="'rope_wobble'"):
    DecoderConfig.from_hf(dict(given, rope_wobble=3))
  with pytest.raises(UserError, match="'query_pre_attn_scalar'"):  # a Gemma field on a Llama
    DecoderConfig.from_hf(dict(given, query_pre_attn_scalar=16))
  with pytest.raises(UserError, match="'LlamaForSequenceClassification'"):
    DecoderConfig.from_hf(dict(given, architectures=['LlamaForSequenceClassification']))
  with pytest.raises(UserError, match="'falcon'"):
    DecoderConfig.from_hf(dict(given, model_type='falcon'))
  with pytest.raises(UserError, match='rope_interleaved'):
    DecoderConfig.from_hf(dict(given, rope_interleaved=True))
  assert DecoderConfig.from_hf(dict(given, rope_interleaved=False, is_llama_config=True)) == \
      DecoderConfig.from_hf(given)
  with pytest.raises(UserError, match=r'rope_parameters.rope_type .*yarn'):
    DecoderConfig.from_hf(dict(given, rope_parameters=dict(rope_type='yarn', factor=2.0)))


def test_a_mixture_of_equal_experts_computes_the_dense_model(saved):
  """Mixtral's routing weights sum to 1 over the chosen experts: when every expert is the
  dense model's MLP, whatever the router chooses, the logits are the dense model's."""
  model, _, dense_config, dense = saved('mistral')
  config = DecoderConfig.from_hf(dict(
      dense_config.to_hf(), model_type='mixtral', architectures=['MixtralForCausalLM'],
      num_local_experts=3, num_experts_per_tok=2))
  rng = np.random.default_rng(0)
  experts = {}
  for path, leaf in tree_lib.flatten(dense).items():
    layer, mlp, rest = path.partition('/mlp/')
    for e in range(3) if mlp else ():
      experts[f'{layer}/mlp/experts_{e}/{rest}'] = leaf
    if mlp and rest == 'gate/kernel':
      experts[f'{layer}/mlp/router/kernel'] = rng.normal(size=(SIZES['hidden_size'], 3))
    if not mlp:
      experts[path] = leaf
  tokens = random_tokens()
  got = ours(config, tree_lib.unflatten(experts), tokens, np.ones_like(tokens, bool))
  np.testing.assert_allclose(got, theirs(model, tokens), rtol=0, atol=ATOL)
  with pytest.raises(UserError, match='num_experts_per_tok = 4 exceeds num_local_experts = 3'):
    DecoderConfig.from_hf(dict(config.to_hf(), num_experts_per_tok=4))


def test_tensors_that_do_not_fit_are_named(saved):
  model, _, config, _ = saved('llama')
  tensors = {n: p.detach().numpy() for n, p in model.state_dict().items()}
  del tensors['model.layers.1.self_attn.k_proj.weight']
  tensors['model.extra.weight'] = np.zeros(3, np.float32)
  tensors['model.norm.weight'] = np.zeros(7, np.float32)
  with pytest.raises(UserError, match=r'missing model\.layers\.1\.self_attn\.k_proj\.weight; '
                     r'unexpected model\.extra\.weight; model\.norm\.weight has shape \(7,\)'):
    hf_decoder.to_params(tensors, config)


def test_merges_read_each_layer_as_the_matrix_transformers_holds(saved):
  """The matrix an SVD-era merge takes of each kernel (merging.ops.matrices) is the layer's
  weight as transformers stores it, outputs × inputs: Llama's query, key and value kernels
  (in, heads, dim) have no bias to tell their output axes."""
  model, _, _, params = saved('llama')
  theirs = [p.detach().numpy() for p in model.state_dict().values() if p.ndim == 2]
  flat = tree_lib.flatten(params)
  views = {path: view for path, view in ops.matrices(params).items() if view is not None}
  assert 'blocks_0/attn/query/kernel' in views and 'blocks_0/attn/out/kernel' in views
  for path, view in views.items():
    ours = np.asarray(view.of(flat[path]))
    assert any(t.shape == ours.shape and np.array_equal(t, ours) for t in theirs), path


def test_params_take_the_regimes_and_the_sharding_rules(saved):
  """Attention-only fine-tuning finds Wq, Wk, Wv, Wo of every layer; every leaf has one
  logical axis per dimension, kv_heads on the key and value projections."""
  _, _, _, params = saved('qwen3')
  chosen = tree_lib.select(params, [attention_only.ATTENTION_WEIGHTS])
  assert sorted(p for p, on in chosen.items() if on) == sorted(
      f'blocks_{i}/attn/{n}/kernel' for i in range(2) for n in ('query', 'key', 'value', 'out'))
  for path, leaf in tree_lib.flatten(params).items():
    axes = tree_lib.first_match(path, sharding.LOGICAL_AXES)
    assert len(axes) in (0, leaf.ndim), path
  axes = lambda path: tree_lib.first_match(path, sharding.LOGICAL_AXES)
  assert axes('blocks_0/attn/key/kernel') == ('embed', 'kv_heads', 'head_dim')
  assert axes('blocks_0/attn/key/bias') == ('kv_heads', 'head_dim')
  assert axes('blocks_0/mlp/down/kernel') == ('mlp', 'embed')
  assert axes('embed/embedding') == ('vocab', 'embed')


def test_rematerialised_layers_give_the_same_loss_and_gradients(saved):
  """remat recomputes each layer in the backward pass: the same function, the same gradient."""
  _, _, config, params = saved('llama')
  tokens = random_tokens()
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  mask = np.ones_like(tokens, bool)

  def loss(params, remat):
    logits = decoder.Decoder(config, remat=remat).apply({'params': params}, tokens, positions,
                                                        mask)[0]
    return jax.nn.log_softmax(logits)[..., 0].mean()

  plain = jax.value_and_grad(loss)(params, False)
  recomputed = jax.value_and_grad(loss)(params, True)
  program = str(jax.make_jaxpr(loss, static_argnums=1)(params, True))
  assert program.count('remat') == config.num_layers  # one rematerialised call per layer
  np.testing.assert_allclose(recomputed[0], plain[0], rtol=1e-6)
  for path, g in tree_lib.flatten(recomputed[1]).items():
    np.testing.assert_allclose(g, tree_lib.flatten(plain[1])[path], rtol=1e-5, atol=1e-7,
                               err_msg=path)
