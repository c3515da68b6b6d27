"""Fine-tuning a decoder in every regime (editing.text_finetune): the answer-only causal-LM loss
against transformers' and a numpy cross-entropy, what each regime's task vector moves, TaLoS's
calibration logits, and the tangent regimes' first-order Taylor model."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
import transformers

from editing import text_finetune
from editing import tree as tree_lib
from editing.errors import UserError
from editing.models import decoder
from editing.models.decoder_config import DecoderConfig
from editing.regimes import talos
from tests.test_hf import random_model
from third_party import hf_decoder

SIZES = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, vocab_size=64, head_dim=8)
EOS = 1
RANK = 2
# name: (the regime's settings, the learning rate: LoRA's factors take larger steps, as usual)
REGIMES = {'full': ({}, 3e-2), 'attention_only': ({}, 3e-2), 'linearized': ({}, 3e-2),
           'talos': ({'keep': 0.5, 'rounds': 2}, 3e-2), 'lora': ({'rank': RANK}, 1e-1),
           'l_lora': ({'rank': RANK}, 1e-1)}
TANGENT = ('linearized', 'l_lora')
SETTINGS = dict(steps=8, batch_size=16, learning_rate=3e-2, weight_decay=0.01, warmup_steps=0,
                grad_clip=1.0, seed=0, checkpoint_every=8, log_every=8)
QKVO = r'blocks_\d+/attn/(query|key|value|out)/kernel'


def copy_task(n=16, seed=0):
  """Prompts of 2 to 5 random tokens; each answer is the prompt's last token, then EOS."""
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(2, SIZES['vocab_size'], rng.integers(2, 6))) for _ in range(n)]
  return prompts, [[p[-1], EOS] for p in prompts]


@pytest.fixture(scope='module', name='llama')
def llama_fixture():
  """(transformers model, our config, our params θ0) of a tiny random Llama."""
  hf_config = transformers.LlamaConfig(**SIZES, attn_implementation='eager')
  model = random_model(transformers.LlamaForCausalLM, hf_config)
  config = DecoderConfig.from_hf(hf_config.to_diff_dict())
  theta0 = hf_decoder.to_params({k: v.numpy() for k, v in model.state_dict().items()}, config)
  return model, config, theta0


@pytest.fixture(scope='module', name='data')
def data_fixture():
  return text_finetune.rows(*copy_task(), length=8)


@pytest.fixture(scope='module', name='finetuned')
def finetuned_fixture(llama, data, tmp_path_factory):
  """regime name -> (the regime, its task vector), each fine-tuned once."""
  _, config, theta0 = llama
  made = {}

  def get(name):
    if name not in made:
      settings, learning_rate = REGIMES[name]
      chosen = text_finetune.regime(name, settings)
      vector = text_finetune.finetune(
          ml_collections.ConfigDict(dict(SETTINGS, learning_rate=learning_rate)), config=config,
          theta0=theta0, chosen=chosen, data=data, task='copy',
          workdir=str(tmp_path_factory.mktemp(name)))
      made[name] = chosen, vector
    return made[name]

  return get


def numpy_answer_loss(logits, tokens, loss_mask):
  """−mean over answer tokens t of log softmax(logits[t − 1])[tokens[t]], in float64."""
  total, count = 0.0, 0
  for i, t in zip(*np.nonzero(loss_mask)):
    z = np.asarray(logits[i, t - 1], np.float64)
    log_p = z - z.max() - np.log(np.sum(np.exp(z - z.max())))
    total -= log_p[tokens[i, t]]
    count += 1
  return total / count


def logits(config, params, data):
  return np.asarray(decoder.Decoder(config).apply({'params': params}, data.tokens,
                                                  data.positions, data.mask)[0])


def dense_delta(vector, theta0):
  """τ as a θ0-shaped tree of arrays, zero where the vector holds nothing."""
  return jax.tree.map(jnp.subtract, vector.apply_to(theta0), theta0)


def tangent_logits(config, theta0, tau, data):
  """f(θ0) + J_θ f(θ0) τ, with jax.jvp."""
  f = lambda p: decoder.Decoder(config).apply({'params': p}, data.tokens, data.positions,
                                              data.mask)[0]
  out, dout = jax.jvp(f, (theta0,), (tau,))
  return np.asarray(out + dout)


def model_logits(name, config, theta0, vector, data):
  """The fine-tuned model's logits: the model at θ0 + τ, or its tangent model at θ0."""
  if name in TANGENT:
    return tangent_logits(config, theta0, dense_delta(vector, theta0), data)
  return logits(config, vector.apply_to(theta0), data)


def test_rows_are_prompt_then_answer_right_padded_with_answer_only_loss_mask():
  got = text_finetune.rows([[5, 6, 7], [8]], [[9], [10, 11]], length=5, pad_id=3)
  np.testing.assert_array_equal(got.tokens, [[5, 6, 7, 9, 3], [8, 10, 11, 3, 3]])
  np.testing.assert_array_equal(got.positions, [[0, 1, 2, 3, 0], [0, 1, 2, 0, 0]])
  np.testing.assert_array_equal(got.mask, [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(got.loss_mask, [[0, 0, 0, 1, 0], [0, 1, 1, 0, 0]])
  inputs, loss_mask = got.batch(np.array([1]))
  np.testing.assert_array_equal(inputs[0], [got.tokens[1], got.positions[1], got.mask[1]])
  np.testing.assert_array_equal(loss_mask, got.loss_mask[1:])


def test_rows_refuse_pairs_that_do_not_fit():
  with pytest.raises(UserError, match='pair 1 has 4 tokens, more than length = 3'):
    text_finetune.rows([[1], [1, 2]], [[3], [3, 4]], length=3)
  with pytest.raises(UserError, match='prompt 0 is empty'):
    text_finetune.rows([[]], [[3]])


def test_finetune_refuses_token_ids_outside_the_vocabulary(llama, tmp_path):
  _, config, theta0 = llama
  with pytest.raises(UserError, match=r'data: token ids span \[1, 64\]'):
    text_finetune.finetune(ml_collections.ConfigDict(SETTINGS), config=config, theta0=theta0,
                           chosen=text_finetune.regime('full'), task='copy', workdir=str(tmp_path),
                           data=text_finetune.rows([[1]], [[64]]))


def test_answer_loss_is_cross_entropy_over_answer_tokens_only(data):
  logits_ = np.random.default_rng(0).normal(size=data.tokens.shape + (SIZES['vocab_size'],))
  loss, _ = text_finetune.answer_loss(jnp.asarray(logits_), data.tokens, data.loss_mask)
  np.testing.assert_allclose(loss, numpy_answer_loss(logits_, data.tokens, data.loss_mask),
                             rtol=1e-5)
  # A prompt token as a target (or padding) is never scored; an answer token is.
  prompt, answer = data.tokens.copy(), data.tokens.copy()
  prompt[:, 1] = (prompt[:, 1] + 1) % SIZES['vocab_size']
  answer[data.loss_mask > 0] = 0
  assert not data.loss_mask[:, 1].any()
  np.testing.assert_allclose(text_finetune.answer_loss(logits_, prompt, data.loss_mask)[0], loss,
                             rtol=1e-6)
  assert abs(text_finetune.answer_loss(logits_, answer, data.loss_mask)[0] - loss) > 1e-3


def test_loss_at_theta0_is_transformers_loss_with_prompt_labels_ignored(llama, data):
  model, config, theta0 = llama
  full = text_finetune.regime('full')
  loss_fn = text_finetune.loss_fn(full.training_encoder(text_finetune.apply_fn(config)))
  ours, _ = loss_fn(theta0, {'theta0': theta0}, *data.batch(np.arange(len(data))), None)
  labels = np.where(data.loss_mask > 0, data.tokens, -100)
  with torch.no_grad():
    theirs = model(input_ids=torch.from_numpy(data.tokens).long(),
                   attention_mask=torch.from_numpy(data.mask).long(),
                   labels=torch.from_numpy(labels).long()).loss.item()
  np.testing.assert_allclose(ours, theirs, rtol=1e-5)


def test_lora_targets_q_k_v_o_unless_told_otherwise(llama):
  _, _, theta0 = llama
  assert text_finetune.regime('lora').targets == QKVO
  with_mlp = text_finetune.regime('l_lora', {'targets': text_finetune.ATTENTION_MLP})
  assert sorted(with_mlp.targeted(theta0)) == sorted(
      f'blocks_0/{m}/kernel' for m in ('attn/query', 'attn/key', 'attn/value', 'attn/out',
                                       'mlp/gate', 'mlp/up', 'mlp/down'))


@pytest.mark.parametrize('name', sorted(REGIMES))
def test_training_lowers_the_answer_loss(llama, data, finetuned, name):
  _, config, theta0 = llama
  _, vector = finetuned(name)
  before = numpy_answer_loss(logits(config, theta0, data), data.tokens, data.loss_mask)
  after = numpy_answer_loss(model_logits(name, config, theta0, vector, data), data.tokens,
                            data.loss_mask)
  assert after < 0.9 * before, (before, after)


def changed(vector, theta0):
  return {p for p, d in tree_lib.flatten(dense_delta(vector, theta0)).items() if np.any(d)}


@pytest.mark.parametrize('name', ['full', 'linearized'])
def test_dense_regimes_move_every_leaf(llama, finetuned, name):
  _, _, theta0 = llama
  assert changed(finetuned(name)[1], theta0) == set(tree_lib.flatten(theta0))


def test_attention_only_moves_exactly_the_q_k_v_o_kernels(llama, finetuned):
  _, _, theta0 = llama
  expected = {p for p in tree_lib.flatten(theta0) if re.fullmatch(QKVO, p)}
  assert len(expected) == 4 and changed(finetuned('attention_only')[1], theta0) == expected


@pytest.mark.parametrize('name', ['lora', 'l_lora'])
def test_lora_deltas_are_of_rank_at_most_r_on_q_k_v_o_only(llama, finetuned, name):
  _, _, theta0 = llama
  _, vector = finetuned(name)
  assert sorted(vector.delta) == sorted(p for p in tree_lib.flatten(theta0)
                                        if re.fullmatch(QKVO, p))
  for path, factors in vector.delta.items():
    matrix = np.asarray(factors.matrix())
    assert np.any(matrix) and np.linalg.matrix_rank(matrix) <= RANK, path
  assert changed(vector, theta0) == set(vector.delta)


def test_l_lora_trains_b_only(llama, finetuned):
  _, _, theta0 = llama
  chosen, vector = finetuned('l_lora')
  initial = tree_lib.flatten(chosen.initial(theta0, jax.random.PRNGKey(SETTINGS['seed'])))
  for path, factors in vector.delta.items():
    np.testing.assert_array_equal(factors.a, initial[f'{path}/a'])


def test_talos_moves_only_masked_entries_of_eligible_leaves(llama, data, finetuned):
  _, config, theta0 = llama
  chosen, vector = finetuned('talos')
  mask = text_finetune.update_mask(chosen, text_finetune.apply_fn(config), theta0, data,
                                   jax.random.PRNGKey(SETTINGS['seed']))
  flat = tree_lib.flatten(theta0)
  eligible = {p for p in flat if any(re.fullmatch(e, p) for e in talos.DECODER_ELIGIBLE)}
  assert set(mask) == eligible and 'embed/embedding' not in eligible
  kept = sum(int(m.sum()) for m in mask.values())
  assert kept == round(REGIMES['talos'][0]['keep'] * sum(m.size for m in mask.values()))
  delta = tree_lib.flatten(dense_delta(vector, theta0))
  for path, d in delta.items():
    allowed = mask[path] if path in mask else np.zeros(np.shape(d), bool)
    assert not np.any(np.asarray(d)[~allowed]), path
  assert changed(vector, theta0) and changed(vector, theta0) <= eligible


def test_talos_calibration_reads_the_logits_before_each_answer_token(llama):
  model, config, theta0 = llama
  prompts, answers = copy_task(3, seed=1)
  calibration = text_finetune.rows(prompts, answers, length=8)
  inputs = text_finetune.answer_token_inputs(calibration)
  got = text_finetune.read_logits(text_finetune.apply_fn(config)(theta0, inputs), inputs)
  expected = []
  for prompt, answer in zip(prompts, answers):
    with torch.no_grad():
      alone = model(torch.tensor([prompt + answer])).logits[0].numpy()
    expected += [alone[len(prompt) - 1 + k] for k in range(len(answer))]
  np.testing.assert_allclose(got, np.stack(expected), atol=1e-5)


@pytest.mark.parametrize('name', TANGENT)
def test_tangent_regimes_train_the_first_order_taylor_model(llama, data, finetuned, name):
  """The loss the loop minimised, at the trained params, is that of f(θ0) + J τ (jax.jvp),
  which differs from the model's own at θ0 + τ."""
  _, config, theta0 = llama
  chosen, vector = finetuned(name)
  if name == 'l_lora':
    trained = tree_lib.unflatten({f'{p}/{k}': getattr(f, k) for p, f in vector.delta.items()
                                  for k in 'ab'})
  else:
    trained = vector.apply_to(theta0)
  loss_fn = text_finetune.loss_fn(chosen.training_encoder(text_finetune.apply_fn(config)))
  ours, _ = loss_fn(trained, {'theta0': theta0}, *data.batch(np.arange(len(data))), None)
  tangent = tangent_logits(config, theta0, dense_delta(vector, theta0), data)
  np.testing.assert_allclose(ours, numpy_answer_loss(tangent, data.tokens, data.loss_mask),
                             rtol=1e-5)
  nonlinear = numpy_answer_loss(logits(config, vector.apply_to(theta0), data), data.tokens,
                                data.loss_mask)
  assert abs(nonlinear - float(ours)) > 1e-4
