"""Scoring against numpy over transformers' logits, on the tiny random Llama of
tests/test_decoder.py."""

import numpy as np
import pytest
import torch

from editing import scoring
from editing.errors import UserError
from tests.test_generate import NEW_TOKENS
from tests.test_generate import PAD
from tests.test_generate import model_and_ours
from tests.test_generate import prompts
from tests.test_generate import transformers_greedy

ATOL = 1e-5


def reference_log_p(model, tokens):
  """numpy: log p(tokens[t+1] | tokens[:t+1]) by transformers, t = 0..len − 2, and whether
  each is the argmax."""
  with torch.no_grad():
    logits = model(torch.tensor([list(tokens)])).logits[0].double().numpy()
  shifted = logits - logits.max(-1, keepdims=True)
  log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  following = np.asarray(tokens[1:])
  return log_p[np.arange(len(following)), following], log_p[:-1].argmax(-1) == following


def test_continuation_log_likelihoods_match_transformers():
  model, config, params = model_and_ours('llama')
  prompt_list, continuations = prompts([3, 7, 1, 5], seed=4), prompts([4, 1, 6, 2], seed=5)
  # The continuation that greedy decoding makes is greedy.
  continuations[3] = list(transformers_greedy(model, [prompt_list[3]], eos=None)[0, :2])
  got = scoring.continuation_log_likelihoods(config, params, prompt_list, continuations,
                                             batch_size=2)
  for prompt, continuation, scored in zip(prompt_list, continuations, got):
    log_p, greedy = reference_log_p(model, prompt + continuation)
    np.testing.assert_allclose(scored.log_likelihoods, log_p[len(prompt) - 1:], atol=ATOL)
    assert scored.greedy == greedy[len(prompt) - 1:].all()
  assert got[3].greedy and not got[0].greedy
  with pytest.raises(UserError, match='empty prompt'):
    scoring.continuation_log_likelihoods(config, params, [[]], [[5]])


def test_perplexity_scores_each_token_once_with_its_window_context():
  model, config, params = model_and_ours('llama')
  stream = prompts([41], seed=6)[0]
  window, stride = 16, 6
  scored = []
  for i in range(1, len(stream)):
    start = max(0, -(-(i - window + 1) // stride)) * stride  # the first window holding i
    log_p, _ = reference_log_p(model, stream[start:start + window])
    scored.append(log_p[i - start - 1])
  got = scoring.perplexity(config, params, stream, window=window, stride=stride, batch_size=4)
  assert got.tokens == len(stream) - 1
  np.testing.assert_allclose(got.negative_log_likelihood, -np.sum(scored), rtol=1e-6)
  np.testing.assert_allclose(got.perplexity, np.exp(-np.mean(scored)), rtol=1e-6)
  with pytest.raises(UserError, match='stride = 16'):
    scoring.perplexity(config, params, stream, window=16, stride=16)


def test_multiple_choice_takes_the_best_sum_and_the_best_sum_per_byte():
  model, config, params = model_and_ours('llama')
  questions = []
  for seed in range(3):
    prompt = prompts([6], seed=10 + seed)[0]
    choices = prompts([1, 2, 3, 2], seed=20 + seed)
    questions.append((prompt, choices, ['a', 'bb', 'ccc', 'éé']))
  got = scoring.multiple_choice_batch(config, params, questions, batch_size=4)
  differs = False
  for (prompt, choices, texts), choice in zip(questions, got):
    sums = np.array([reference_log_p(model, prompt + c)[0][len(prompt) - 1:].sum()
                     for c in choices])
    per_byte = sums / np.array([1, 2, 3, 4])  # 'éé' is 4 bytes in UTF-8
    np.testing.assert_allclose(choice.log_likelihoods, sums, atol=ATOL * 4)
    assert (choice.acc, choice.acc_norm) == (sums.argmax(), per_byte.argmax())
    differs |= sums.argmax() != per_byte.argmax()
  assert differs, 'the questions should tell acc from acc_norm'
  single = scoring.multiple_choice(config, params, *questions[0])
  np.testing.assert_allclose(single.log_likelihoods, got[0].log_likelihoods, atol=1e-6)


def test_exact_match_compares_greedy_answers_cut_at_their_stop():
  model, config, params = model_and_ours('llama')
  batch = prompts([5, 9, 7])
  greedy = transformers_greedy(model, batch, eos=None)
  stop = [int(greedy[0, 4])]
  cut = [list(row[:list(row).index(stop[0])]) if stop[0] in row else list(row)
         for row in greedy]
  decode = lambda ids: ' '.join(str(i) for i in ids)
  answers = [decode(cut[0]), decode(cut[1]) + ' 7', '  ' + decode(cut[2]) + '\n']
  share, predictions = scoring.exact_match(config, params, batch, answers, decode,
                                           max_new_tokens=NEW_TOKENS, stop_sequences=[stop],
                                           pad_id=PAD)
  assert predictions == [decode(c) for c in cut]
  assert share == pytest.approx(2 / 3)
