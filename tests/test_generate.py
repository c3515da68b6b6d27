"""Generation against transformers' generate, the KV cache against the full forward, stops,
sampling and buckets, on the tiny random decoders of tests/test_decoder.py."""

import functools

import jax
import numpy as np
import pytest
import torch

from editing import generate as generate_lib
from editing.errors import UserError
from editing.models import decoder
from editing.models.decoder_config import DecoderConfig
from tests.test_decoder import tiny
from third_party import hf_decoder

NEW_TOKENS = 12
PAD = 0


@functools.lru_cache(maxsize=None)
def model_and_ours(family):
  """(transformers model, our config, our params) of the tiny `family` model."""
  model = tiny(family)
  config = DecoderConfig.from_hf(model.config.to_dict())
  tensors = {n: p.detach().numpy() for n, p in model.state_dict().items()}
  return model, config, hf_decoder.to_params(tensors, config)


def prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [list(rng.integers(3, 128, n)) for n in lengths]


def transformers_greedy(model, batch, eos):
  """transformers' greedy continuation of left-padded prompts: (rows, NEW_TOKENS), padded."""
  width = max(len(p) for p in batch)
  ids = torch.full((len(batch), width), PAD)
  mask = torch.zeros((len(batch), width), dtype=torch.long)
  for i, p in enumerate(batch):
    ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
  with torch.no_grad():
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=PAD, eos_token_id=eos)
  new = out[:, width:].numpy()
  return np.pad(new, ((0, 0), (0, NEW_TOKENS - new.shape[1])), constant_values=PAD)


@pytest.mark.parametrize('family', ['llama', 'gemma2'])
def test_greedy_generation_is_token_identical_to_transformers(family):
  model, config, params = model_and_ours(family)
  batch = prompts([5, 9, 7])
  eos = model.generation_config.eos_token_id
  with jax.default_matmul_precision('highest'):
    got = generate_lib.generate(config, params, batch, max_new_tokens=NEW_TOKENS, eos_ids=[eos],
                                pad_id=PAD)
  np.testing.assert_array_equal(got.tokens, transformers_greedy(model, batch, eos))
  assert got.tokens_per_second > 0
  compiled = len(generate_lib._COMPILED)
  # Another request of the same bucket (4 rows, prompts of at most 16 tokens) runs the same
  # program, and each row's tokens do not depend on the others.
  again = generate_lib.generate(config, params, batch[1:] + prompts([16, 3], seed=1),
                                max_new_tokens=NEW_TOKENS, eos_ids=[eos], pad_id=PAD)
  assert len(generate_lib._COMPILED) == compiled
  np.testing.assert_array_equal(again.tokens[:2], got.tokens[1:])


def test_cached_decoding_equals_the_full_forward():
  """Tokens fed one at a time through the cache (gemma2: a sliding window shorter than the
  sequence, soft-capping) get the logits of one forward over the whole batch."""
  _, config, params = model_and_ours('gemma2')
  model = decoder.Decoder(config)
  rows, length = 2, 16
  tokens = np.random.default_rng(3).integers(3, 128, (rows, length))
  mask = np.ones_like(tokens, bool)
  mask[1, :3] = False  # row 1 left-padded
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  apply = jax.jit(lambda p, t, pos, m, c: model.apply({'params': p}, t, pos, m, c))
  with jax.default_matmul_precision('highest'):
    full, _ = apply(params, tokens, positions, mask, None)
    cache = decoder.init_cache(config, rows, length)
    stepped = []
    for t in range(length):
      logits, cache = apply(params, tokens[:, t:t + 1], positions[:, t:t + 1],
                            mask[:, t:t + 1], cache)
      stepped.append(np.asarray(logits))
  stepped = np.concatenate(stepped, axis=1)
  np.testing.assert_allclose(stepped[mask], np.asarray(full)[mask], rtol=0, atol=1e-5)
  assert int(cache.length) == length


def stop_end(row, eos_ids, stops):
  """numpy: how many tokens of an unstopped `row` a stopping run keeps: up to the first EOS
  id or the first end of a stop sequence, all of them if neither occurs."""
  for end in range(1, len(row) + 1):
    if row[end - 1] in eos_ids or any(list(row[max(end - len(s), 0):end]) == s for s in stops):
      return end
  return len(row)


def test_rows_stop_at_eos_ids_and_stop_sequences():
  _, config, params = model_and_ours('llama')
  batch = prompts([5, 9, 7])
  free = generate_lib.generate(config, params, batch, max_new_tokens=NEW_TOKENS).tokens
  stops, eos_ids = [list(free[0, 3:5])], [int(free[1, 6])]
  got = generate_lib.generate(config, params, batch, max_new_tokens=NEW_TOKENS,
                              eos_ids=eos_ids, stop_sequences=stops, pad_id=PAD)
  ends = [stop_end(row, eos_ids, stops) for row in free]
  assert ends[0] <= 5 and ends[1] <= 7
  np.testing.assert_array_equal(got.lengths, ends)
  for row, end in enumerate(ends):
    np.testing.assert_array_equal(got.tokens[row, :end], free[row, :end])
    assert (got.tokens[row, end:] == PAD).all()


def nucleus_probabilities(logits, temperature, top_p):
  """numpy: softmax(logits / T) kept on the fewest most likely tokens whose mass reaches
  top_p, renormalised."""
  p = np.exp((logits - logits.max()) / temperature)
  p /= p.sum()
  order = np.argsort(-p)
  before = np.cumsum(p[order]) - p[order]
  kept = np.zeros_like(p)
  kept[order[before < top_p]] = p[order[before < top_p]]
  return kept / kept.sum()


def test_sampling_draws_from_the_tempered_nucleus():
  logits = np.array([2.0, 1.5, 1.0, 0.2, -1.0, -3.0], np.float32)
  keys = jax.random.split(jax.random.PRNGKey(0), 10000)
  draw = jax.jit(jax.vmap(generate_lib.sample_next, in_axes=(None, 0, None, None)))
  for temperature, top_p in [(1.0, 1.0), (0.7, 0.8), (2.0, 0.5)]:
    tokens = np.asarray(draw(logits, keys, temperature, top_p))
    frequencies = np.bincount(tokens, minlength=len(logits)) / len(keys)
    np.testing.assert_allclose(frequencies, nucleus_probabilities(logits, temperature, top_p),
                               atol=0.02)
  assert (np.asarray(draw(logits, keys[:50], 0.0, 1.0)) == 0).all()  # temperature 0: argmax


def test_sampled_generation_follows_its_key():
  _, config, params = model_and_ours('llama')
  batch = prompts([5, 9, 7])
  run = lambda seed: generate_lib.generate(
      config, params, batch, max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9,
      key=jax.random.PRNGKey(seed)).tokens
  np.testing.assert_array_equal(run(1), run(1))
  assert (run(1) != run(2)).any()
  with pytest.raises(UserError, match='needs a key'):
    generate_lib.generate(config, params, batch, max_new_tokens=4, temperature=1.0)
  with pytest.raises(UserError, match='max_position_embeddings'):
    generate_lib.generate(config, params, batch, max_new_tokens=config.max_position_embeddings)


@pytest.mark.parametrize('kwargs, named', [
    (dict(eos_ids=[None]), 'eos_ids holds None'),  # a tokenizer's missing special token
    (dict(eos_ids=[10_000]), 'eos_ids holds 10000'),
    (dict(stop_sequences=[[3, -1]]), 'stop_sequences holds -1'),
])
def test_a_stop_id_outside_the_vocabulary_is_named(kwargs, named):
  _, config, params = model_and_ours('llama')
  with pytest.raises(UserError, match=named):
    generate_lib.generate(config, params, prompts([5]), max_new_tokens=4, **kwargs)
