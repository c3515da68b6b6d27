"""MoE upscaling of dense Llamas into a Mixtral (and Qwen3s into a Qwen3-MoE) from a
mergekit-moe YAML: the routers against a
numpy port of mergekit-moe's gate code run on transformers' model, the output loaded by
transformers with our logits, the experts and the base's tensors where mergekit puts them,
equal experts computing the dense model, and the inputs refused by name."""

import os

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
import yaml

from configs import merge_checkpoints
from editing.errors import UserError
from editing.models import hf
from editing.models import tokenizer as tokenizer_lib
from merging.checkpoints import job
from third_party import hf_decoder

ALPHABET = 'abcdefghijklmnopqrstuvwxyz .,:'
SIZES = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4 + len(ALPHABET), tie_word_embeddings=False)
PROMPTS = {  # expert: (positive, negative)
    0: (['add two and three', 'sum of numbers'], ['a poem about rain']),
    1: (['write a poem', 'a verse on the sea', 'sing of autumn'], []),
}


def llama(directory, seed: int, family: str = 'llama', **overrides):
  """A random tiny Llama (or Qwen3) saved with the characters tokenizer; seeds give different
  models."""
  torch.manual_seed(seed)
  config_class, model_class = {
      'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      'qwen3': (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
  config = config_class(**{**SIZES, **overrides}, attn_implementation='eager')
  model = model_class(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  model.save_pretrained(directory)
  tokenizer_lib.characters(ALPHABET).save(str(directory))
  return model


@pytest.fixture(scope='module', name='models')
def models_fixture(tmp_path_factory):
  root = tmp_path_factory.mktemp('dense')
  made = {name: llama(root / name, seed) for seed, name in enumerate(('base', 'a', 'b'))}
  return root, made


def recipe(path, root, **changes) -> str:
  doc = {'base_model': str(root / 'base'), 'gate_mode': 'hidden', 'experts_per_token': 2,
         'experts': [{'source_model': str(root / name), 'positive_prompts': PROMPTS[k][0],
                      **({'negative_prompts': PROMPTS[k][1]} if PROMPTS[k][1] else {})}
                     for k, name in enumerate(('a', 'b'))]}
  doc.update(changes)
  path.write_text(yaml.safe_dump(doc))
  return str(path)


def upscale(tmp_path, root, name='moe', **changes) -> str:
  config = merge_checkpoints.get_config()
  config.update(mergekit_moe=recipe(tmp_path / f'{name}.yaml', root, **changes),
                output=str(tmp_path / name))
  job.run(config, str(tmp_path))
  return str(tmp_path / name)


def tensors(directory) -> dict:
  return {n: hf.Checkpoint(directory).tensor(n) for n in hf.Checkpoint(directory).files}


def mergekit_hidden_gates(model, prompts_of, mode):
  """mergekit-moe's router.get_gate_params for the hidden modes, ported to numpy over
  transformers' float32 model: BOS + prompt, left-padded with BOS, hidden_states[:-1] at the
  last position (or the mean over real tokens for hidden_avg), mean over prompts, positives
  minus negatives, each layer's vector unit-norm."""
  tokens = tokenizer_lib.characters(ALPHABET)
  bos = tokens.token_id('bos_token')

  def states(prompts):
    ids = [[bos] + tokens.encode(p, add_special_tokens=False) for p in prompts]
    length = max(map(len, ids))
    padded = np.array([[bos] * (length - len(x)) + x for x in ids])
    mask = np.array([[0] * (length - len(x)) + [1] * len(x) for x in ids])
    with torch.no_grad():
      out = model(torch.from_numpy(padded), attention_mask=torch.from_numpy(mask),
                  output_hidden_states=True)
    hidden = np.stack([h.numpy() for h in out.hidden_states[:-1]])  # (layers, batch, seq, d)
    if mode == 'hidden_avg':
      hidden = (hidden * mask[None, :, :, None]).sum(2) / mask.sum(1)[None, :, None]
    else:
      hidden = hidden[:, :, -1]
    return hidden.mean(1)

  gates = []
  for positive, negative in prompts_of:
    v = states(positive) - (states(negative) if negative else 0)
    gates.append(v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-8))
  return np.stack(gates, axis=1)


@pytest.mark.parametrize('mode', ['hidden', 'hidden_avg'])
def test_hidden_routers_are_mergekits_gates(tmp_path, models, mode):
  root, made = models
  out = upscale(tmp_path, root, gate_mode=mode)
  expected = mergekit_hidden_gates(made['base'], [PROMPTS[0], PROMPTS[1]], mode)
  written = tensors(out)
  for i in range(SIZES['num_hidden_layers']):
    np.testing.assert_allclose(written[f'model.layers.{i}.block_sparse_moe.gate.weight'],
                               expected[i], atol=2e-5, err_msg=f'layer {i}')


def test_cheap_embed_routers_are_mergekits_gates(tmp_path, models):
  root, made = models
  out = upscale(tmp_path, root, gate_mode='cheap_embed')
  embedding = made['base'].model.embed_tokens.weight.detach().numpy()
  tokens = tokenizer_lib.characters(ALPHABET)
  unit = lambda v: v / np.linalg.norm(v)
  summed = lambda prompts: unit(np.eye(SIZES['vocab_size'])[np.concatenate(
      [[tokens.token_id('bos_token')] + tokens.encode(p, add_special_tokens=False)
       for p in prompts])].sum(0) @ embedding)
  expected = [unit(summed(PROMPTS[0][0]) - summed(PROMPTS[0][1])), summed(PROMPTS[1][0])]
  written = tensors(out)
  for i in range(SIZES['num_hidden_layers']):
    np.testing.assert_allclose(written[f'model.layers.{i}.block_sparse_moe.gate.weight'],
                               np.stack(expected), atol=1e-6)


def test_the_mixtral_loads_in_transformers_with_our_logits_and_mergekits_tensors(
    tmp_path, models):
  root, _ = models
  out = upscale(tmp_path, root)
  written, base = tensors(out), tensors(root / 'base')
  sources = [tensors(root / 'a'), tensors(root / 'b')]
  for name, value in written.items():
    if '.block_sparse_moe.experts.' in name:
      layer, e, w = name.split('.')[2], int(name.split('.')[5]), name.split('.')[6]
      dense = {'w1': 'gate_proj', 'w3': 'up_proj', 'w2': 'down_proj'}[w]
      np.testing.assert_array_equal(value, sources[e][f'model.layers.{layer}.mlp.{dense}.weight'])
    elif '.block_sparse_moe.gate.' not in name:
      np.testing.assert_array_equal(value, base[name])
  assert not any('.mlp.' in n for n in written)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation='eager')
  assert type(model).__name__ == 'MixtralForCausalLM'
  config, params = hf_decoder.load(out)
  assert (config.num_experts, config.experts_per_token) == (2, 2)
  tokens = np.random.default_rng(0).integers(0, SIZES['vocab_size'], (2, 12))
  from tests import test_decoder  # pylint: disable=g-import-not-at-top
  ours = test_decoder.ours(config, params, tokens, np.ones_like(tokens, bool))
  np.testing.assert_allclose(ours, test_decoder.theirs(model, tokens), atol=1e-5)
  assert os.path.exists(os.path.join(out, 'tokenizer.json'))


def test_qwen3_models_upscale_to_a_qwen3_moe_that_transformers_loads(tmp_path):
  """mergekit-moe writes Qwen3 inputs as a Qwen3-MoE: the experts under the dense names,
  renormalised top-k; transformers' logits are ours, and equal experts give the dense model."""
  root = tmp_path / 'qwen3'
  made = {name: llama(root / name, seed, 'qwen3') for seed, name in enumerate(('base', 'a', 'b'))}
  out = upscale(tmp_path, root, name='qwen3_moe')
  written, sources = tensors(out), [tensors(root / 'a'), tensors(root / 'b')]
  for i in range(SIZES['num_hidden_layers']):
    for e, source in enumerate(sources):
      for leaf in ('gate', 'up', 'down'):
        np.testing.assert_array_equal(
            written[f'model.layers.{i}.mlp.experts.{e}.{leaf}_proj.weight'],
            source[f'model.layers.{i}.mlp.{leaf}_proj.weight'])
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation='eager')
  assert type(model).__name__ == 'Qwen3MoeForCausalLM' and model.config.norm_topk_prob
  config, params = hf_decoder.load(out)
  assert (config.model_type, config.num_experts, config.normalize_top_k) == ('qwen3_moe', 2, True)
  tokens = np.random.default_rng(0).integers(0, SIZES['vocab_size'], (2, 12))
  from tests import test_decoder  # pylint: disable=g-import-not-at-top
  ours = test_decoder.ours(config, params, tokens, np.ones_like(tokens, bool))
  np.testing.assert_allclose(ours, test_decoder.theirs(model, tokens), atol=1e-5)
  same = upscale(tmp_path, root, name='qwen3_same', gate_mode='random',
                 experts=[{'source_model': str(root / 'base')}] * 3)
  model = transformers.AutoModelForCausalLM.from_pretrained(same, attn_implementation='eager')
  with torch.no_grad():
    np.testing.assert_allclose(model(torch.from_numpy(tokens)).logits.numpy(),
                               made['base'](torch.from_numpy(tokens)).logits.numpy(), atol=1e-5)


def test_a_shared_expert_makes_a_qwen2_moe_that_transformers_loads(tmp_path, models):
  """mergekit-moe's Qwen MoE: the experts and the shared one under Qwen2-MoE's names, zero q, k,
  v biases for a Llama base, the shared gate set from its prompts as a router row is."""
  root, _ = models
  shared = {'source_model': str(root / 'base'), 'positive_prompts': PROMPTS[0][0],
            'negative_prompts': PROMPTS[0][1]}
  out = upscale(tmp_path, root, name='qwen2_moe', shared_experts=[shared])
  written, base = tensors(out), tensors(root / 'base')
  for i in range(SIZES['num_hidden_layers']):
    for leaf in ('gate', 'up', 'down'):
      np.testing.assert_array_equal(
          written[f'model.layers.{i}.mlp.shared_expert.{leaf}_proj.weight'],
          base[f'model.layers.{i}.mlp.{leaf}_proj.weight'])
    np.testing.assert_allclose(written[f'model.layers.{i}.mlp.shared_expert_gate.weight'][0],
                               written[f'model.layers.{i}.mlp.gate.weight'][0], atol=1e-7)
    assert not np.any(written[f'model.layers.{i}.self_attn.k_proj.bias'])
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation='eager')
  assert type(model).__name__ == 'Qwen2MoeForCausalLM'
  config, params = hf_decoder.load(out)
  assert (config.model_type, config.num_experts, config.shared_expert_size) == (
      'qwen2_moe', 2, SIZES['intermediate_size'])
  tokens = np.random.default_rng(0).integers(0, SIZES['vocab_size'], (2, 12))
  from tests import test_decoder  # pylint: disable=g-import-not-at-top
  ours = test_decoder.ours(config, params, tokens, np.ones_like(tokens, bool))
  np.testing.assert_allclose(ours, test_decoder.theirs(model, tokens), atol=1e-5)


def test_equal_experts_compute_the_dense_model(tmp_path, models):
  root, made = models
  experts = [{'source_model': str(root / 'base')}] * 3
  out = upscale(tmp_path, root, gate_mode='random', experts=experts, experts_per_token=2)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation='eager')
  tokens = torch.from_numpy(np.random.default_rng(1).integers(0, SIZES['vocab_size'], (2, 12)))
  with torch.no_grad():
    np.testing.assert_allclose(model(tokens).logits.numpy(), made['base'](tokens).logits.numpy(),
                               atol=1e-5)


@pytest.mark.parametrize('changes,message', [
    (dict(experts_per_token=3), 'experts_per_token = 3 but only 2 experts'),
    ('two shared', r'shared_experts lists 2; a Qwen2-MoE takes exactly one'),
    (dict(architecture='Qwen3 MoE', shared_experts=[{'source_model': '.'}]),
     r'shared_experts\[0\].positive_prompts is empty'),
    (dict(architecture='qwen'), "architecture = 'qwen': editmerge writes Mixtral, Qwen MoE"),
    (dict(architecture='Qwen3 MoE'), 'is a llama; a mixtral is upscaled from llama or mistral '
                                     'models; a qwen3_moe is upscaled from qwen3 models'),
    (dict(architecture='Qwen MoE'), 'a qwen2_moe takes exactly one shared expert'),
    (dict(gate_mode='learned'), "gate_mode = 'learned'; choose one of"),
    ('empty prompts', r'experts\[1\].positive_prompts is empty'),
    ('same prompts', 'every expert has the same prompts'),
    ('other architecture', r'experts\[1\].source_model = .* has intermediate_size = 64, the '
                           'base_model 48'),
    ('extra tensor', r'base_model = .*: unexpected model.extra.weight'),
])
def test_bad_recipes_are_named_in_one_line_and_nothing_is_written(tmp_path, models, changes,
                                                                   message):
  root, _ = models
  if changes == 'two shared':
    changes = dict(shared_experts=[{'source_model': str(root / 'a'),
                                    'positive_prompts': ['x']}] * 2)
  elif changes == 'empty prompts':
    changes = dict(experts=[{'source_model': str(root / 'a'), 'positive_prompts': ['x']},
                            {'source_model': str(root / 'b'), 'positive_prompts': []}])
  elif changes == 'same prompts':
    changes = dict(experts=[{'source_model': str(root / n), 'positive_prompts': ['x']}
                            for n in ('a', 'b')])
  elif changes == 'other architecture':
    llama(tmp_path / 'wide', 5, intermediate_size=64)
    changes = dict(experts=[{'source_model': str(root / 'a'), 'positive_prompts': ['x']},
                            {'source_model': str(tmp_path / 'wide'), 'positive_prompts': ['y']}])
  elif changes == 'extra tensor':
    base = tmp_path / 'base'
    llama(base, 0)
    weights = safetensors.numpy.load_file(str(base / 'model.safetensors'))
    weights['model.extra.weight'] = np.zeros(3, np.float32)
    safetensors.numpy.save_file(weights, str(base / 'model.safetensors'),
                                metadata={'format': 'pt'})
    changes = dict(base_model=str(base))
  with pytest.raises(UserError, match=message):
    upscale(tmp_path, root, **changes)
  assert not os.path.exists(tmp_path / 'moe')
  assert not os.path.exists(tmp_path / 'moe.partial')
