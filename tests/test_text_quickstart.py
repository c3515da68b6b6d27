"""The text quickstart end to end on its tiny config (the shipped decoder, three tasks): the shipped
decoder is θ0, exact match is what greedy generation writes, and fine-tuning, addition and
negation move exact match the way the papers report, by margins measured on suite seeds."""

import filecmp
import hashlib
import json

import numpy as np
import pytest
import safetensors.numpy

from configs import merge as merge_config
from configs import text_quickstart
from editing import checkpoint
from editing import generate
from editing import scoring
from editing import tree as tree_lib
from editing.data import text_suite
from editing.errors import UserError
from editing.jobs import evaluate_checkpoint
from editing.jobs import experiment
from editing.jobs import pretrain
from editing.jobs import quickstart
from editing.jobs import text_data
from editing.jobs import workdir as workdir_lib
from editing.models.decoder_config import DecoderConfig
from merging.jobs import export
from merging.jobs import merge
from third_party import hf_decoder

# Margins half of the smaller gain that suite seeds 0 and 1 showed (docs/text_suite.md): mean
# exact match rose 27.1 and 26.6 points by fine-tuning and 4.7 and 3.1 by addition (at α 0.25);
# negation took every target to 0% while general text kept 93.4% of its likelihood or more.
FINETUNE_GAIN = 0.13
ADDITION_GAIN = 0.015
CONTROL_KEPT = 0.9


@pytest.fixture(name='text_run', scope='module')
def text_run_fixture(tmp_path_factory):
  config = text_quickstart.get_config('tiny')
  workdir = str(tmp_path_factory.mktemp('text_quickstart'))
  return config, workdir, quickstart.run(config, workdir)


def test_the_shipped_decoder_is_theta0_and_its_bytes_are_the_recorded_ones(text_run):
  config, workdir, _ = text_run
  with open(pretrain.SHIPPED_DECODER) as f:
    record = json.load(f)
  path = pretrain.shipped_backbone(config)
  with open(path, 'rb') as f:
    assert hashlib.sha256(f.read()).hexdigest() == record['sha256']
  assert filecmp.cmp(path, workdir_lib.pretrained_file(workdir), shallow=False)
  assert experiment.weights_of(record['model']) == experiment.weights_of(config.model.to_dict())
  other = text_quickstart.get_config('tiny')
  other.pretrain.steps = 10
  with pytest.raises(UserError, match=r'config.pretrain.steps = 10 \(shipped: '):
    pretrain.shipped_backbone(other)


def test_exact_match_is_the_share_of_greedy_answers_that_are_the_answer(text_run):
  config, workdir, _ = text_run
  theta0, apply_fn = experiment.load_pretrained(workdir, config.model)
  vector, _ = checkpoint.load_task_vector(workdir_lib.task_vector_file(workdir, 'full', 'sort'))
  params = vector.apply_to(theta0)
  tokens = text_data.tokenizer(config)
  examples = text_suite.load_task('sort', seed=config.suite.seed, train_size=1,
                                  val_size=1, test_size=config.suite.test_size).test
  data = experiment.load_task(config, 'sort').test
  evaluator = experiment.evaluator(config, apply_fn, 'full')
  right = data.correct(evaluator.predictions(theta0, params, None, data))
  eos = tokens.token_id('eos_token')
  out = generate.generate(DecoderConfig.from_hf(experiment.weights_of(config.model.to_dict())),
                          params, [tokens.encode(p) for p, _ in examples], max_new_tokens=12,
                          eos_ids=[eos], pad_id=tokens.token_id('pad_token'))
  greedy = [list(row[:n]) == tokens.encode(a, add_special_tokens=False) + [eos]
            for row, n, (_, a) in zip(out.tokens, out.lengths, examples)]
  np.testing.assert_array_equal(right, greedy)
  assert 0 < np.mean(greedy) < 1, 'a check that all or none pass would not tell them apart'


def test_fine_tuning_addition_and_negation_move_exact_match_as_expected(text_run):
  config, _, results = text_run
  result = results['regimes']['full']
  tasks = result['tasks']
  pretrained = np.mean([result['pretrained'][t] for t in tasks])
  finetuned = np.mean([result['finetuned'][t]['test'] for t in tasks])
  assert finetuned >= pretrained + FINETUNE_GAIN
  assert result['addition']['mean_test'] >= pretrained + ADDITION_GAIN
  for t in tasks:
    negation = result['negation'][t]
    assert negation['target_test'] <= result['pretrained'][t] / 2
    assert negation['control_test'] >= CONTROL_KEPT * result['pretrained'][result['control_task']]


def test_the_merge_sweep_runs_on_the_text_tasks(text_run):
  _, workdir, _ = text_run
  config = merge_config.get_config('text,tiny')
  config.merge.methods = 'task_arithmetic,ties,regmean'
  sweep = merge.run(config, workdir)['full']
  assert set(sweep['methods']) == {'task_arithmetic', 'ties', 'regmean'}
  arithmetic = sweep['methods']['task_arithmetic']
  assert arithmetic['mean_test'] >= np.mean(list(sweep['pretrained'].values()))


def test_a_merge_exports_to_a_causal_lm_and_tokenizer_that_transformers_loads(text_run,
                                                                            tmp_path):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  config, workdir, _ = text_run
  merge_settings = merge_config.get_config('text,tiny')
  merge_settings.merge.methods = 'task_arithmetic'
  merge.run(merge_settings, workdir)
  config.export.output = str(tmp_path / 'merged')
  export.run(config, workdir)
  model = transformers.AutoModelForCausalLM.from_pretrained(config.export.output)
  tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(config.export.output)
  prompt = 'sort: dbca='
  ids = text_data.tokenizer(config).encode(prompt)
  assert tokenizer(prompt)['input_ids'] == ids
  with torch.no_grad():
    theirs = model(torch.tensor([ids])).logits.numpy()[0]
  theta0, apply_fn = experiment.load_pretrained(workdir, config.model)
  merged = export.merged_params(config, workdir, theta0)
  inputs = np.stack([np.array([ids]), np.arange(len(ids))[None], np.ones((1, len(ids)), int)],
                    axis=1).astype(np.int32)
  ours = np.asarray(apply_fn(merged, inputs))[0]
  np.testing.assert_allclose(theirs, ours, atol=2e-4, rtol=2e-4)



def test_a_fine_tune_and_theta0_export_as_causal_lms(text_run, tmp_path):
  """config.export.task: θ0 + τ of one task, or θ0, as the safetensors files hold them."""
  config, workdir, _ = text_run
  theta0 = safetensors.numpy.load_file(workdir_lib.pretrained_file(workdir))
  tau = safetensors.numpy.load_file(workdir_lib.task_vector_file(workdir, 'full', 'sort'))
  for task, expected in (('sort', {k: theta0[k] + tau[k] for k in theta0}),
                         (export.PRETRAINED, theta0)):
    config.export.update(task=task, output=str(tmp_path / task))
    export.run(config, workdir)
    _, params = hf_decoder.load(config.export.output)
    for path, value in tree_lib.flatten(params).items():
      np.testing.assert_allclose(value, expected[path], rtol=1e-6, atol=1e-7, err_msg=path)
  config.export.update(answers=str(tmp_path / 'answers'))
  export.run(config, workdir)
  test = evaluate_checkpoint.read_pairs(str(tmp_path / 'answers' / 'test.jsonl'))
  suite = config.suite
  expected_test = [pair for name in ('reverse', 'sort', 'cipher') for pair in text_suite.load_task(
      name, seed=suite.seed, train_size=suite.train_size, val_size=suite.val_size,
      test_size=suite.test_size).test]
  assert test == expected_test
  train = scoring.read_documents(str(tmp_path / 'answers' / 'train.jsonl'))
  assert len(train) == 3 * suite.train_size and train[0].startswith('reverse: ')
  config.export.update(task='add', answers='', output=str(tmp_path / 'add'))
  with pytest.raises(UserError, match=r"config.export.task = 'add' is not a task of this "
                                      r"experiment; choose one of reverse,sort,cipher"):
    export.run(config, workdir)
  assert not (tmp_path / 'add').exists()
