"""Scoring against numpy over transformers' logits, on the tiny random Llama of
tests/test_decoder.py."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
import torch
from tokenizers import models

from editing import scoring
from editing.errors import UserError
from editing.models import tokenizer as tokenizer_lib
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


def reference_rolling(model, stream, window, stride):
  """numpy: log p of tokens 1.. of `stream`, each in the first window (of `window` tokens,
  starting every `stride`) that holds it and a token before it."""
  scored, by_start = [], {}
  for i in range(1, len(stream)):
    start = max(0, -(-(i - window + 1) // stride)) * stride  # the first window holding i
    if start not in by_start:
      by_start[start] = reference_log_p(model, stream[start:start + window])[0]
    scored.append(by_start[start][i - start - 1])
  return np.array(scored)


def test_perplexity_scores_each_token_once_with_its_window_context():
  model, config, params = model_and_ours('llama')
  stream = prompts([41], seed=6)[0]
  window, stride = 16, 6
  scored = reference_rolling(model, stream, window, stride)
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


# A character tokenizer of the tiny Llama's vocabulary: ids known without it.
CHARS = {c: 3 + i for i, c in enumerate('abcdefghij .\n')}
BOS, EOS = 1, 2


def char_tokenizer(bos=True):
  backend = tokenizers.Tokenizer(models.BPE(vocab={'<s>': BOS, '</s>': EOS, **CHARS}, merges=[]))
  backend.add_special_tokens(['<s>', '</s>'])
  special = {'bos_token': '<s>' if bos else None, 'eos_token': '</s>', 'unk_token': None,
             'pad_token': None}
  return tokenizer_lib.Tokenizer(backend, special, None, 'chars')


def documents():
  rng = np.random.default_rng(7)
  return [''.join(rng.choice(list(CHARS), n)) for n in (30, 7, 1)]


def reference_file_perplexity(model, texts, prefix, window, stride):
  """numpy: (perplexity, NLL, tokens) of each text after `prefix`, windows within each."""
  scored = np.concatenate([reference_rolling(model, [prefix] + [CHARS[c] for c in text],
                                             window, stride) for text in texts])
  return np.exp(-scored.mean()), -scored.sum(), len(scored)


def test_file_perplexity_scores_each_document_after_a_prefix_token(tmp_path):
  model, config, params = model_and_ours('llama')
  texts, window, stride = documents(), 16, 6
  (tmp_path / 'corpus.txt').write_text('\n\n'.join(texts), newline='')
  with open(tmp_path / 'corpus.jsonl', 'w') as f:
    for i, text in enumerate(texts):
      f.write(json.dumps({'id': i, 'text': text, 'body': text}) + '\n')
    f.write('\n' + json.dumps({'text': '', 'body': ''}) + '\n')  # passed over
  pq.write_table(pa.table({'id': list(range(3)), 'text': texts}), tmp_path / 'corpus.parquet')

  def score(name, tokenizer=char_tokenizer(), **kwargs):
    return scoring.file_perplexity(config, params, tokenizer, str(tmp_path / name),
                                   window=window, stride=stride, batch_size=4, **kwargs)

  whole = reference_file_perplexity(model, ['\n\n'.join(texts)], BOS, window, stride)
  apart = reference_file_perplexity(model, texts, BOS, window, stride)
  after_eos = reference_file_perplexity(model, texts, EOS, window, stride)
  cases = [(score('corpus.txt'), whole), (score('corpus.jsonl'), apart),
           (score('corpus.jsonl', field='body'), apart), (score('corpus.parquet'), apart),
           (score('corpus.jsonl', tokenizer=char_tokenizer(bos=False)), after_eos)]
  for got, (ppl, nll, tokens) in cases:
    np.testing.assert_allclose(got.negative_log_likelihood, nll, rtol=1e-6)
    np.testing.assert_allclose(got.perplexity, ppl, rtol=1e-6)
    assert got.tokens == tokens
  # Every character is scored: the whole text's, or each document's apart.
  assert (whole[2], apart[2]) == (sum(map(len, texts)) + 4, sum(map(len, texts)))


def test_text_files_that_cannot_be_scored_are_named(tmp_path):
  (tmp_path / 'empty.txt').write_text('')
  (tmp_path / 'empty.jsonl').write_text('\n\n')
  (tmp_path / 'titles.jsonl').write_text('{"text": "ab"}\n{"title": "c"}\n')
  (tmp_path / 'numbers.jsonl').write_text('{"text": 5}\n')
  (tmp_path / 'broken.jsonl').write_text('{"text": \n')
  (tmp_path / 'corpus.csv').write_text('text\nab\n')
  (tmp_path / 'latin1.jsonl').write_bytes('{"text": "café"}\n'.encode('latin-1'))
  pq.write_table(pa.table({'body': ['ab']}), tmp_path / 'body.parquet')
  pq.write_table(pa.table({'text': [1, 2]}), tmp_path / 'numbers.parquet')
  pq.write_table(pa.table({'text': ['ab', None]}), tmp_path / 'null.parquet')
  refusals = [('empty.txt', {}, 'holds no text to score'),
              ('empty.jsonl', {}, 'holds no text to score'),
              ('titles.jsonl', {}, "line 2: no field 'text'"),
              ('numbers.jsonl', {}, "line 1: field 'text' is a int, not text"),
              ('broken.jsonl', {}, 'line 1: not a JSON object'),
              ('latin1.jsonl', {}, 'is not UTF-8 text'),
              ('corpus.csv', {}, 'read from .txt, .jsonl, .parquet files, not .csv'),
              ('body.parquet', {}, "has no column 'text'; it has \\['body'\\]"),
              ('numbers.parquet', {}, "column 'text' holds int64, not text"),
              ('null.parquet', {}, "row 1 of column 'text' is null"),
              ('body.parquet', {'field': 'title'}, "has no column 'title'"),
              ('missing.jsonl', {}, 'does not exist')]
  for name, kwargs, message in refusals:
    path = str(tmp_path / name)
    with pytest.raises(UserError, match=message) as raised:
      scoring.read_documents(path, **kwargs)
    assert str(raised.value).startswith(path), raised.value
