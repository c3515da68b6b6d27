"""The text suite through the jobs: its tokenizer, its rows, exact match, and what the jobs
refuse of a decoder's experiment."""

import os

import jax
import ml_collections
import numpy as np
import pytest

from configs import merge as merge_config
from configs import text_quickstart
from editing import text_finetune
from editing import tree as tree_lib
from editing.data import text_suite
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import experiment
from editing.jobs import pretrain
from editing.jobs import text_data
from editing.models import gguf
from editing.models import tokenizer as tokenizer_lib
from editing.models.decoder_config import DecoderConfig
from merging.jobs import inputs as inputs_lib
from merging.jobs import merge
from tests import tiny_gguf

SPECIALS = 4  # <pad>, <s>, </s>, <unk>


def test_the_character_tokenizer_gives_one_id_per_character_and_survives_saving(tmp_path):
  tokens = tokenizer_lib.characters(text_suite.ALPHABET)
  text = 'weekday: 1987-06-23=tuesday. add: 17+25=42'
  expected = [1] + [SPECIALS + text_suite.ALPHABET.index(c) for c in text]
  assert tokens.encode(text) == expected
  assert tokens.decode(tokens.encode(text), skip_special_tokens=True) == text
  assert tokens.encode('a?b', add_special_tokens=False) == [
      SPECIALS + text_suite.ALPHABET.index('a'), 3, SPECIALS + text_suite.ALPHABET.index('b')]
  tokens.save(str(tmp_path))
  read = tokenizer_lib.Tokenizer.from_directory(str(tmp_path))
  assert read.encode(text) == expected and read.token_id('eos_token') == 2
  assert read.vocab_size == SPECIALS + len(text_suite.ALPHABET)
  with pytest.raises(UserError, match='each character once'):
    tokenizer_lib.characters('abca')


def test_every_character_of_the_suite_is_in_its_alphabet_and_every_row_fits():
  config = text_quickstart.get_config()
  longest = 0
  for name in text_suite.TASKS:
    task = text_suite.load_task(name, seed=1, train_size=500, val_size=100, test_size=100)
    for prompt, answer in task.train + task.val + task.test:
      assert set(prompt + answer) <= set(text_suite.ALPHABET), (name, prompt, answer)
      longest = max(longest, len(prompt) + len(answer) + 2)  # BOS and EOS
  for document in text_suite.pretraining_mixture(1, 2000):
    assert set(document) <= set(text_suite.ALPHABET), document
    longest = max(longest, len(document) + 2)
  assert longest <= config.suite.length <= config.model.max_position_embeddings


def test_pairs_score_the_answer_and_its_eos_and_nothing_else():
  tokens = tokenizer_lib.characters(text_suite.ALPHABET)
  code = {c: SPECIALS + text_suite.ALPHABET.index(c) for c in text_suite.ALPHABET}
  data = text_finetune.pairs(tokens, [('add: 1+2=', '3'), ('sort: ba=', 'ab')], length=16)
  assert data.tokens[0, :12].tolist() == [1] + [code[c] for c in 'add: 1+2=3'] + [2]
  labels = np.full((2, 16), -1)
  labels[0, 9:11] = [code['3'], 2]  # read at '=' and at '3'
  labels[1, 9:12] = [code['a'], code['b'], 2]
  np.testing.assert_array_equal(data.labels, labels)
  documents = text_finetune.documents(tokens, ['a cat.'], length=10)
  assert documents.labels[0].tolist() == [code[c] for c in 'a cat.'] + [2, -1, -1, -1]


def test_a_row_is_right_only_when_every_answer_token_is_and_text_scores_its_likelihood():
  tokens = tokenizer_lib.characters(text_suite.ALPHABET)
  code = {c: SPECIALS + text_suite.ALPHABET.index(c) for c in text_suite.ALPHABET}
  data = text_finetune.pairs(tokens, [('a=', 'b'), ('a=', 'b'), ('c=', 'dd')], length=6)
  predicted = np.zeros((3, 6), np.int32)
  predicted[0, 2:4] = [code['b'], 2]
  predicted[1, 2:4] = [code['b'], 5]  # the answer without its EOS: greedy would go on
  predicted[2, 2:5] = [code['d'], code['d'], 2]
  np.testing.assert_array_equal(data.correct(predicted), [True, False, True])
  assert data.score(predicted) == pytest.approx(2 / 3)
  text = text_finetune.documents(tokens, ['ab', 'c'], length=5, metric='likelihood')
  features = np.zeros((2, 5, 2), np.float32)
  features[..., 1] = np.log([[0.5, 0.25, 0.5, 9, 9], [0.125, 1.0, 9, 9, 9]])
  # Scored: 'a', 'b', EOS of the first row, 'c', EOS of the second; 9 marks what is not.
  expected = np.exp(np.mean(np.log([0.5, 0.25, 0.5, 0.125, 1.0])))
  assert text.score(text.predictions(features)) == pytest.approx(expected)
  assert text.take(1).metric == 'likelihood'


def test_disentanglement_sees_a_row_change_only_where_its_answer_does():
  tokens = tokenizer_lib.characters(text_suite.ALPHABET)
  data = text_finetune.pairs(tokens, [('a=', 'b'), ('a=', 'b')], length=6)
  features = np.zeros((2, 6, 2), np.float32)
  other = features.copy()
  other[0, 0, 0] = 7  # the argmax after BOS, inside the prompt
  other[1, 2, 0] = 7  # the argmax after '=', the answer's first token
  before, after = data.predictions(features), data.predictions(other)
  np.testing.assert_array_equal((before != after).any(axis=1), [False, True])


@pytest.fixture(name='tiny_decoder', scope='module')
def tiny_decoder_fixture():
  config = text_quickstart.get_config('tiny')
  config.model.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
  module, apply_fn = experiment.model(config.model)
  data = text_finetune.pairs(text_data.tokenizer(config), [('add: 1+2=', '3')], 16)
  inputs = data.packed()
  params = module.init(jax.random.PRNGKey(0), inputs[:, 0], inputs[:, 1],
                       inputs[:, 2].astype(bool))['params']
  return config, params, apply_fn


def test_a_merge_reads_unlabeled_text_at_the_prompts_end_and_never_the_answer(tiny_decoder):
  config, params, apply_fn = tiny_decoder
  tokens = text_data.tokenizer(config)
  examples = [('add: 1+2=', '3'), ('reverse: abc=', 'cba')]
  scrambled = [('add: 1+2=', '9'), ('reverse: abc=', 'zzz')]
  encoder = lambda theta0, p, x: apply_fn(p, x)
  read = []
  for pairs in (examples, scrambled):
    rows = text_finetune.pairs(tokens, pairs, 24)
    task = text_finetune.TextTask('t', rows, rows, rows)
    data = inputs_lib.text_task_data(encoder, params, task, 'test', train_examples=8)
    assert data.labels is None and len(data.images) == 2  # one sample per row
    read.append(np.asarray(data.logits_fn(params, data.images)))
  np.testing.assert_array_equal(read[0], read[1])
  train = inputs_lib.text_task_data(encoder, params, task, 'train', train_examples=1)
  assert train.labels.tolist() == tokens.encode('9', add_special_tokens=False) + [2]


def test_a_decoder_pretrains_on_text_and_an_encoder_on_images(tmp_path):
  config = text_quickstart.get_config('tiny')
  config.pretrain.corpus = 'captions'
  with pytest.raises(UserError, match="'captions' is not a corpus for a decoder.*'mixture'"):
    pretrain.run(config, str(tmp_path))
  assert not list(tmp_path.iterdir())


def test_the_text_suites_settings_are_checked_for_a_decoder():
  config = text_quickstart.get_config('tiny')
  config.suite.val_size = 0
  with pytest.raises(UserError, match=r'config.suite.val_size = 0'):
    checks.validate(config)
  config = text_quickstart.get_config('tiny')
  config.suite.tasks = 'add,digits'
  with pytest.raises(UserError, match=r"unknown task\(s\) \['digits'\]"):
    experiment.tasks(config)


def test_a_merge_that_perturbs_pixels_is_refused_for_a_decoder(tmp_path):
  config = merge_config.get_config('text,tiny')
  assert 'dam' not in config.merge.methods.split(',')
  config.merge.methods = 'task_arithmetic,dam'
  with pytest.raises(UserError, match=r"\['dam'\] perturb the inputs"):
    merge.run(config, str(tmp_path))
  assert not list(tmp_path.iterdir())


def test_the_text_config_is_a_decoder_that_transformers_could_read():
  config = text_quickstart.get_config()
  assert experiment.is_decoder(config)
  decoder = DecoderConfig.from_hf(experiment.weights_of(config.model.to_dict()))
  assert decoder.vocab_size == tokenizer_lib.characters(text_suite.ALPHABET).vocab_size
  assert not experiment.is_decoder(ml_collections.ConfigDict({'model': {'width': 8}}))


def test_real_weights_are_theta0_and_their_tokenizer_reads_the_suite(tmp_path):
  path = str(tmp_path / 'm.gguf')
  # A tokenizer that adds no BOS itself, as SmolLM2's: every row still starts with one.
  tiny_gguf.write(path, tiny_gguf.llama_tensors(tied=True), add_bos=False)
  config = text_quickstart.get_config('tiny')
  config.weights = path
  _, expected, file_tokenizer = gguf.load_gguf(path)
  model = gguf.File(path).config
  config.model = ml_collections.ConfigDict(dict(
      DecoderConfig.from_hf(model).to_hf(), hidden_size=model['hidden_size'] * 2,
      dtype='float32'))
  with pytest.raises(UserError, match=r'is not the model the config describes: '
                                      r'config.model.hidden_size = 512 \(checkpoint: 256\)'):
    pretrain.run(config, str(tmp_path / 'wrong'))
  assert not os.path.exists(tmp_path / 'wrong' / 'pretrain' / 'params.safetensors')

  config.model.hidden_size = model['hidden_size']
  pretrain.run(config, str(tmp_path / 'workdir'))
  theta0, _ = experiment.load_pretrained(str(tmp_path / 'workdir'), config.model)
  for leaf, value in tree_lib.flatten(expected).items():
    np.testing.assert_array_equal(tree_lib.flatten(theta0)[leaf], value, err_msg=leaf)
  tokens = text_data.tokenizer(config)
  prompt, answer = 'add: 12+34=', '46'
  assert tokens.encode(prompt, add_special_tokens=False) == file_tokenizer.encode(
      prompt, add_special_tokens=False)
  rows = text_data.load_task(config, 'reverse').train
  assert rows.tokens.shape[1] == config.suite.length
  general = text_data.load_task(config, text_suite.HELD_OUT_TEXT).val
  assert (general.tokens[:, 0] == file_tokenizer.token_id('bos_token')).all()
  data = text_finetune.pairs(tokens, [(prompt, answer)], 24)
  bos, eos = file_tokenizer.token_id('bos_token'), file_tokenizer.token_id('eos_token')
  assert data.tokens[0, data.mask[0]].tolist() == (
      [bos] + file_tokenizer.encode(prompt, add_special_tokens=False)
      + file_tokenizer.encode(answer, add_special_tokens=False) + [eos])


def test_launch_finetune_takes_the_configs_tasks_and_names_another(tmp_path, run_python):
  args = ['-m', 'launch.finetune', '--config=configs/text_quickstart.py:tiny',
          f'--workdir={tmp_path}']
  proc = run_python(args + ['--task=digits'], check=False)
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      'error: --task=digits is not a task of this experiment; choose one of reverse,sort,cipher')
  proc = run_python(args + ['--task=sort'], check=False)
  assert proc.returncode == 1
  assert 'error: no pretrained backbone at' in proc.stderr.strip().splitlines()[-1]
