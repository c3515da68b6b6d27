"""The checkpoint scoring job against transformers: two tiny random Llamas with a
character-level tokenizer, their perplexity, multiple-choice log-likelihoods and greedy
answers computed from transformers' logits; the table; the refusals."""

import json
import os

import numpy as np
import pytest
import tokenizers
import torch
import transformers

from configs import evaluate_checkpoint as evaluate_checkpoint_config
from configs import merge_checkpoints as merge_checkpoints_config
from editing.errors import UserError
from editing.jobs import evaluate_checkpoint
from editing.models.tokenizer import Tokenizer
from merging import checkpoints
from tests import tiny_gguf

SPECIAL = ('<unk>', '<s>', '</s>')
CHARACTERS = ' \nabcdefghijklmnopqrstuvwxyz.?'
VOCAB = {token: i for i, token in enumerate(SPECIAL + tuple(CHARACTERS))}
BOS, EOS = VOCAB['<s>'], VOCAB['</s>']
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, head_dim=8, vocab_size=len(VOCAB),
             max_position_embeddings=64, bos_token_id=BOS, eos_token_id=EOS)
DOCUMENTS = ('the cat sat on the mat.', 'a dog ran far away?')
QUESTIONS = (  # lm-eval's plain shape, and ARC's
    {'query': 'where is the cat?', 'choices': ['on the mat', 'in a box'], 'gold': 0},
    {'question': 'what ran', 'choices': {'text': ['cat', 'dog', 'bird'],
                                         'label': ['A', 'B', 'C']}, 'answer': 'B'})
PROMPTS = ('the cat', 'a dog')
NEW_TOKENS = 4
ATOL = 1e-4  # summed float32 log-likelihoods of ~20 tokens


def ids(text: str) -> list[int]:
  return [VOCAB[c] for c in text]


def write_tokenizer(directory) -> None:
  """tokenizer.json of one token per character, and the config naming BOS and EOS."""
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token='<unk>'))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(
      tokenizers.Regex(r'[\s\S]'), behavior='isolated')
  backend.decoder = tokenizers.decoders.Fuse()
  backend.add_special_tokens(list(SPECIAL))
  backend.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>'}, f)


def write_jsonl(path, records) -> str:
  with open(path, 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  return str(path)


@pytest.fixture(scope='module', name='models')
def models_fixture(tmp_path_factory):
  """[(directory, transformers model)] of two tiny random Llamas that differ."""
  made = []
  for seed in (0, 1):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SIZES, attn_implementation='eager')
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
      for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))
    directory = tmp_path_factory.mktemp(f'llama{seed}')
    model.save_pretrained(directory)
    write_tokenizer(directory)
    made.append((str(directory), model))
  return made


def log_probs(model, tokens: list[int]) -> np.ndarray:
  """log p(tokens[t + 1] | tokens[:t + 1]) for each t, from transformers' logits."""
  with torch.no_grad():
    logits = model(torch.tensor([tokens])).logits[0].double().numpy()
  shifted = logits - logits.max(-1, keepdims=True)
  log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return log_p[np.arange(len(tokens) - 1), tokens[1:]]


def greedy(model, prompt: list[int]) -> str:
  """transformers' greedy continuation of `prompt`, stopped at EOS, as text, stripped."""
  tokens = list(prompt)
  for _ in range(NEW_TOKENS):
    with torch.no_grad():
      token = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
    if token == EOS:
      break
    tokens.append(token)
  names = {i: token for token, i in VOCAB.items()}
  return ''.join(names[t] for t in tokens[len(prompt):]).strip()


def config_for(checkpoints, **files):
  config = evaluate_checkpoint_config.get_config()
  config.checkpoints = ','.join(checkpoints)
  config.perplexity.window, config.perplexity.stride = 32, 16
  for section, path in files.items():
    config[section].file = path
  return config


@pytest.fixture(scope='module', name='scored')
def scored_fixture(models, tmp_path_factory):
  """(results, workdir, answers) of one run of the job over both models and every file."""
  data = tmp_path_factory.mktemp('data')
  text = write_jsonl(data / 'text.jsonl', [{'text': d} for d in DOCUMENTS])
  questions = write_jsonl(data / 'questions.jsonl', QUESTIONS)
  # The first answer is the first model's own greedy answer; the second no model's.
  answers = [greedy(models[0][1], [BOS] + ids(PROMPTS[0])), 'not an answer']
  pairs = write_jsonl(data / 'pairs.jsonl',
                      [{'prompt': p, 'answer': a} for p, a in zip(PROMPTS, answers)])
  config = config_for([d for d, _ in models], perplexity=text, multiple_choice=questions,
                      exact_match=pairs)
  config.exact_match.max_new_tokens = NEW_TOKENS
  workdir = str(tmp_path_factory.mktemp('work'))
  return evaluate_checkpoint.run(config, workdir), workdir, answers


def test_perplexity_equals_transformers(models, scored):
  results, _, _ = scored
  for directory, model in models:
    picked = np.concatenate([log_probs(model, [BOS] + ids(d)) for d in DOCUMENTS])
    got = results[directory]['perplexity']
    assert got['tokens'] == len(picked)
    np.testing.assert_allclose(got['negative_log_likelihood'], -picked.sum(), atol=ATOL)
    np.testing.assert_allclose(got['perplexity'], np.exp(-picked.mean()), rtol=1e-4)


def test_multiple_choice_equals_transformers(models, scored):
  results, _, _ = scored
  texts = [('where is the cat?', ['on the mat', 'in a box'], 0),
           ('what ran', ['cat', 'dog', 'bird'], 1)]
  for directory, model in models:
    got = results[directory]['multiple_choice']
    acc, acc_norm = [], []
    for (question, choices, gold), log_likelihoods in zip(texts, got['log_likelihoods']):
      context = [BOS] + ids(question)
      sums = np.array([log_probs(model, context + ids(' ' + c))[len(context) - 1:].sum()
                       for c in choices])
      np.testing.assert_allclose(log_likelihoods, sums, atol=ATOL)
      acc.append(np.argmax(sums) == gold)
      acc_norm.append(np.argmax(sums / [len(c) for c in choices]) == gold)
    assert got['acc'] == np.mean(acc) and got['acc_norm'] == np.mean(acc_norm)


def test_exact_match_equals_transformers(models, scored):
  results, _, answers = scored
  for directory, model in models:
    theirs = [greedy(model, [BOS] + ids(p)) for p in PROMPTS]
    got = results[directory]['exact_match']
    assert got['predictions'] == theirs
    assert got['exact_match'] == np.mean([t == a for t, a in zip(theirs, answers)])
  assert results[models[0][0]]['exact_match']['exact_match'] == 0.5


def test_whitespace_ending_a_question_moves_to_the_choice(models):
  tokenizer = Tokenizer.from_directory(models[0][0])
  prompt, continuation = evaluate_checkpoint.choice_tokens(tokenizer, BOS, 'is it? \n', ' no')
  assert (prompt, continuation) == ([BOS] + ids('is it?'), ids(' \n no'))


def test_results_and_table_written(models, scored):
  results, workdir, _ = scored
  with open(os.path.join(workdir, evaluate_checkpoint.RESULTS)) as f:
    assert json.load(f)['checkpoints'] == results
  with open(os.path.join(workdir, evaluate_checkpoint.TABLE)) as f:
    lines = f.read().splitlines()
  assert lines[0] == '| checkpoint | perplexity | acc | acc_norm | exact_match |'
  assert [line.split(' | ')[0][2:] for line in lines[2:]] == [d for d, _ in models]
  first = results[models[0][0]]
  assert lines[2].split(' | ')[1] == f'{first["perplexity"]["perplexity"]:.4f}'


def test_one_evaluation_alone(models, tmp_path):
  text = tmp_path / 'text.txt'
  text.write_text(DOCUMENTS[0])
  config = config_for([models[1][0]], perplexity=str(text))
  results = evaluate_checkpoint.run(config, str(tmp_path / 'work'))
  assert list(results[models[1][0]]) == ['perplexity']
  with open(tmp_path / 'work' / evaluate_checkpoint.TABLE) as f:
    assert f.readline().strip() == '| checkpoint | perplexity |'


def _refusal_cases(directory, tmp_path):
  """(config, the error's words) of each bad input."""
  text = tmp_path / 'text.txt'
  text.write_text(DOCUMENTS[0])
  bin_file = tmp_path / 'model.bin'
  bin_file.write_bytes(b'')
  empty = tmp_path / 'empty'
  empty.mkdir()

  def questions(record):  # a file of its own per case: every case is made before any runs
    return write_jsonl(tmp_path / f'q{len(os.listdir(tmp_path))}.jsonl', [QUESTIONS[0], record])

  good = dict(perplexity=str(text))
  return [
      (config_for([str(tmp_path / 'missing')], **good), 'missing does not exist'),
      (config_for([str(bin_file)], **good), 'model.bin is neither'),
      (config_for([str(empty)], **good), 'empty has no tokenizer.json'),
      (config_for([directory, directory], **good), 'twice'),
      (config_for([directory]), 'nothing to score'),
      (config_for([directory], multiple_choice=questions({'query': 'q', 'gold': 0})),
       r'q\d.jsonl, line 2: none of the keys \[\'choices\'\]'),
      (config_for([directory], multiple_choice=questions({'choices': ['a'], 'gold': 0})),
       r'line 2: none of the keys \[\'query\', \'question\', \'context\'\]'),
      (config_for([directory], multiple_choice=questions(
          {'query': 'q', 'choices': ['a', 'b'], 'gold': 2})), 'line 2: the gold 2'),
      (config_for([directory], multiple_choice=questions(
          {'query': 'q', 'choices': {'text': ['a', 'b'], 'label': ['A']}, 'label': 'A'})),
       'line 2: choices.label'),
      (config_for([directory], exact_match=write_jsonl(tmp_path / 'p.jsonl',
                                                       [{'prompt': 'a'}])),
       'p.jsonl, line 1: no string "answer"'),
      (config_for([directory], multiple_choice=str(text)), 'read from a .jsonl file'),
  ]


def test_refusals_write_nothing(models, tmp_path):
  for number, (config, words) in enumerate(_refusal_cases(models[0][0], tmp_path)):
    workdir = tmp_path / f'work{number}'
    with pytest.raises(UserError, match=words):
      evaluate_checkpoint.run(config, str(workdir))
    assert not workdir.exists()


def test_settings_checked_by_key(models, tmp_path):
  text = tmp_path / 'text.txt'
  text.write_text(DOCUMENTS[0])
  config = config_for([models[0][0]], perplexity=str(text))
  config.perplexity.window = 1
  with pytest.raises(UserError, match=r'config.perplexity.window = 1'):
    evaluate_checkpoint.run(config, str(tmp_path / 'a'))
  config.perplexity.window, config.perplexity.stride = 8, 8
  with pytest.raises(UserError, match=r'config.perplexity.stride = 8 must be below'):
    evaluate_checkpoint.run(config, str(tmp_path / 'b'))
  assert os.listdir(tmp_path) == ['text.txt']


def test_gguf_checkpoint_beside_a_directory(models, tmp_path):
  """A GGUF file is scored with the tokenizer of its metadata: its perplexity equals what
  transformers' model and tokenizer, both read from the same file, give."""
  tiny_gguf.write(tmp_path / 'm.gguf', tiny_gguf.llama_tensors(tied=True))
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file='m.gguf',
                                                            dtype=torch.float32).eval()
  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file='m.gguf')
  text = tmp_path / 'text.txt'
  text.write_text('hello world, the cat')
  config = config_for([models[0][0], str(tmp_path / 'm.gguf')], perplexity=str(text))
  results = evaluate_checkpoint.run(config, str(tmp_path / 'work'))
  bos = tiny_gguf.TOKENS.index('<|im_start|>')
  picked = log_probs(model, [bos] + theirs.encode(text.read_text(), add_special_tokens=False))
  got = results[str(tmp_path / 'm.gguf')]['perplexity']
  assert got['tokens'] == len(picked)
  np.testing.assert_allclose(got['negative_log_likelihood'], -picked.sum(), atol=ATOL)
  assert list(results) == [models[0][0], str(tmp_path / 'm.gguf')]


def test_a_merge_scores_its_output_beside_its_inputs_in_one_command(models, scored, tmp_path):
  """launch.merge_checkpoints with config.evaluate: the inputs' rows are what the scoring job
  gives them alone, and the merge's row is the merged weights' perplexity by transformers."""
  results, _, _ = scored
  (base, _), (tuned, _) = models
  text = write_jsonl(tmp_path / 'text.jsonl', [{'text': d} for d in DOCUMENTS])
  config = merge_checkpoints_config.get_config()
  config.update(base=base, models=tuned, method='task_arithmetic', scale=0.5,
                output=str(tmp_path / 'merged'))
  config.evaluate.perplexity.update(file=text, window=32, stride=16)
  summary = checkpoints.run(config, str(tmp_path / 'work'))
  scores = summary['scores']
  assert list(scores) == [base, tuned, str(tmp_path / 'merged')]
  for path in (base, tuned):
    assert scores[path]['perplexity'] == pytest.approx(results[path]['perplexity'], rel=1e-9)
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / 'merged'),
                                                             attn_implementation='eager')
  nll = -sum(log_probs(merged, [BOS] + ids(d)).sum() for d in DOCUMENTS)
  count = sum(len(d) for d in DOCUMENTS)
  assert scores[str(tmp_path / 'merged')]['perplexity']['perplexity'] == pytest.approx(
      np.exp(nll / count), rel=1e-4)
  assert os.path.exists(tmp_path / 'work' / evaluate_checkpoint.RESULTS)

  config.update(output=str(tmp_path / 'other'))
  config.evaluate.perplexity.file = str(tmp_path / 'missing.jsonl')
  with pytest.raises(UserError, match='missing.jsonl does not exist'):
    checkpoints.run(config, str(tmp_path / 'work2'))
  assert not os.path.exists(tmp_path / 'other')
