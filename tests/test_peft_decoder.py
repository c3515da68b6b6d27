"""PEFT LoRA adapters on the decoder, both ways, against peft itself: a tiny random Llama (2
layers, hidden 32, 4 query heads over 2 key/value heads) saved by transformers and read by
`hf_decoder.load`; adapters peft makes read here, and task vectors made here loaded by peft,
each with the logits of θ0 + ΔW."""

import os

import jax
import numpy as np
import pytest
import transformers

from editing import text_finetune
from editing import tree as tree_lib
from editing.errors import UserError
from editing.lora import LowRank
from editing.models import peft_adapter
from editing.task_vector import TaskVector
from tests import test_decoder
from tests.test_hf import random_model
from tests.test_peft_adapter import adapted, assert_same_factors, edit_config
from third_party import hf_decoder

peft = pytest.importorskip('peft')

ATTENTION = ['q_proj', 'k_proj', 'v_proj', 'o_proj']
# Largest |ours − peft's| of float32 logits of magnitude ~1 (measured: ≤ 3e-6).
ATOL = 1e-5


@pytest.fixture(scope='module', name='base')
def base_fixture(tmp_path_factory):
  """(its directory, our config, our params) of the tiny Llama, saved once."""
  directory = tmp_path_factory.mktemp('llama')
  test_decoder.tiny('llama').save_pretrained(directory)
  return (str(directory), *hf_decoder.load(str(directory)))


def fresh(directory):
  return transformers.LlamaForCausalLM.from_pretrained(directory).eval()


def logits(config, params, vector=None):
  """Our logits of θ0, or of θ0 + ΔW, over two random rows."""
  tokens = test_decoder.random_tokens()
  params = params if vector is None else vector.apply_to(params)
  return test_decoder.ours(config, params, tokens, np.ones_like(tokens, bool))


@pytest.mark.parametrize('lora', [
    dict(r=4, lora_alpha=8, target_modules=ATTENTION),
    dict(r=4, lora_alpha=8, use_rslora=True, rank_pattern={'v_proj': 2},
         alpha_pattern={'o_proj': 3}, target_modules=ATTENTION + ['gate_proj', 'up_proj',
                                                                 'down_proj'])])
def test_a_peft_adapter_reads_as_peft_applies_it_and_writes_back_as_it_was(base, tmp_path, lora):
  directory, config, params = base
  peft_model = adapted(fresh(directory), tmp_path / 'adapter', **lora)
  vector = peft_adapter.read(str(tmp_path / 'adapter'), config, None, params)
  assert vector.low_rank and vector.regime == 'lora'
  expected = test_decoder.theirs(peft_model, test_decoder.random_tokens())
  assert np.abs(expected - logits(config, params)).max() > 100 * ATOL  # the adapter matters
  np.testing.assert_allclose(logits(config, params, vector), expected, rtol=0, atol=ATOL)
  # Written back: the same factors, bit for bit, which peft loads to the same model.
  peft_adapter.write(str(tmp_path / 'out'), vector, config, None)
  assert_same_factors(tmp_path / 'adapter', tmp_path / 'out')
  reloaded = peft.PeftModel.from_pretrained(fresh(directory), str(tmp_path / 'out')).eval()
  np.testing.assert_allclose(test_decoder.theirs(reloaded, test_decoder.random_tokens()),
                             expected, rtol=0, atol=ATOL)


def trained_vector(params, **settings):
  """The decoder LoRA regime's task vector with random non-zero B, as a fine-tune makes one."""
  chosen = text_finetune.regime('lora', settings)
  factors = tree_lib.flatten(chosen.initial(params, jax.random.PRNGKey(0)))
  rng = np.random.default_rng(0)
  factors = {p: rng.normal(size=np.shape(x)).astype(np.float32) * 0.2 if p.endswith('/b') else x
             for p, x in factors.items()}
  return chosen.task_vector(params, tree_lib.unflatten(factors), task='t')


@pytest.mark.parametrize('settings', [
    dict(rank=4, alpha=16.0),
    dict(rank=2, alpha=3.0, rslora=True, targets=text_finetune.ATTENTION_MLP)])
def test_a_task_vector_written_here_loads_in_peft_as_theta0_plus_its_delta(base, tmp_path,
                                                                           settings):
  directory, config, params = base
  vector = trained_vector(params, **settings)
  peft_adapter.write(str(tmp_path / 'out'), vector, config, None, base_path=directory,
                     theta0=params)
  loaded = peft.PeftModel.from_pretrained(fresh(directory), str(tmp_path / 'out')).eval()
  assert isinstance(loaded, peft.PeftModelForCausalLM)  # one that generates
  expected = logits(config, params, vector)
  np.testing.assert_allclose(test_decoder.theirs(loaded, test_decoder.random_tokens()), expected,
                             rtol=0, atol=ATOL)
  again = peft_adapter.read(str(tmp_path / 'out'), config, None, params)
  assert again.delta.keys() == vector.delta.keys()
  np.testing.assert_allclose(logits(config, params, again), expected, rtol=0, atol=ATOL)


def test_an_adapter_of_a_module_the_decoder_lacks_is_refused_by_name(base, tmp_path):
  directory, config, params = base
  deeper = dict(test_decoder.SIZES, num_hidden_layers=3)
  llama = random_model(transformers.LlamaForCausalLM,
                                    transformers.LlamaConfig(**deeper))
  adapted(llama, tmp_path / 'deeper', r=2, lora_alpha=4, target_modules=ATTENTION)
  with pytest.raises(UserError, match=r'deeper: model\.layers\.2\.self_attn\.[qkvo]_proj is not '
                                      r'a linear layer of a llama decoder'):
    peft_adapter.read(str(tmp_path / 'deeper'), config, None, params)


@pytest.mark.parametrize('key, value', [
    ('alora_invocation_tokens', [3, 4]), ('use_bdlora', {'nblocks': 2}),
    ('arrow_config', {'top_k': 2}), ('velora_config', {'num_groups': 2}),
    ('monteclora_config', {'n_experts': 2}), ('kasa_config', {'beta': 0.1}),
    ('layer_replication', [[0, 2], [1, 2]]), ('target_parameters', ['mlp.gate_proj.weight']),
    ('trainable_token_indices', [5])])
def test_peft_settings_that_change_the_model_beyond_its_factors_are_refused(base, tmp_path, key,
                                                                            value):
  directory, config, params = base
  adapted(fresh(directory), tmp_path / 'adapter', r=2, lora_alpha=4, target_modules=ATTENTION)
  edit_config(tmp_path / 'adapter', **{key: value})
  with pytest.raises(UserError, match=f'adapter: {peft_adapter.CONFIG} sets {key}: '):
    peft_adapter.read(str(tmp_path / 'adapter'), config, None, params)


def test_a_vector_of_leaves_peft_has_no_lora_layer_for_is_not_written(base, tmp_path):
  _, config, params = base
  flat = tree_lib.flatten(params)
  embedding = np.shape(flat['embed/embedding'])
  rng = np.random.default_rng(0)
  on_embedding = TaskVector({'embed/embedding': LowRank(
      rng.normal(size=(embedding[1], 2)).astype(np.float32),
      rng.normal(size=(2, embedding[0])).astype(np.float32), np.float32(1), embedding)},
      ('t',), 'lora', 'b')
  with pytest.raises(UserError, match=r'^embed/embedding: not a linear layer '
                                      r'\(model\.embed_tokens\.weight\)'):
    peft_adapter.write(str(tmp_path / 'embedding'), on_embedding, config, None)
  kernel = np.shape(flat['blocks_0/attn/query/kernel'])
  elsewhere = TaskVector({'blocks_7/attn/query/kernel': LowRank(
      np.ones((32, 2), np.float32), np.ones((2, 32), np.float32), np.float32(1), kernel)},
      ('t',), 'lora', 'b')
  with pytest.raises(UserError, match=r'^blocks_7/attn/query/kernel: the key map of a llama '
                                      'decoder has no Hugging Face name'):
    peft_adapter.write(str(tmp_path / 'elsewhere'), elsewhere, config, None)
  assert not os.path.exists(tmp_path / 'embedding') and not os.path.exists(tmp_path / 'elsewhere')
