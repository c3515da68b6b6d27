"""The data-driven merges of decoder checkpoints, streamed a layer at a time
(merging/checkpoints/calibrated.py), against the in-memory RegMean and RegMean++ of merging/ run
on the whole decoder over the same windows, and the data-free matrix merges against the suite's
merge of the same vectors; RegMean's defining property on a checkpoint (its
solution minimises the summed regression loss of each layer); the refusals."""

import os

import jax
import numpy as np
import pytest

import merging
from editing import text_finetune
from editing import tree as tree_lib
from editing.errors import UserError
from editing.models import decoder
from editing.models.decoder_config import DecoderConfig
from editing.models.tokenizer import Tokenizer
from editing.task_vector import TaskVector
from merging import common
from merging import regmean
from merging import regmean_plusplus
from merging.checkpoints import calibrated
from merging.checkpoints import job
from merging.checkpoints import plan as plan_lib
from tests.test_evaluate_checkpoint import VOCAB, write_tokenizer
from third_party import hf_decoder

LENGTH = 8
# Documents of 8k − 1 characters: with the prefix token, k whole windows each.
DOCUMENTS = ('the cat sat on the mat and the dog ran.', 'a bird flew over.......')
FAMILIES = {
    'llama, untied head': dict(architectures=['LlamaForCausalLM'], model_type='llama',
                               tie_word_embeddings=False),
    'gemma2, tied head': dict(architectures=['Gemma2ForCausalLM'], model_type='gemma2',
                              tie_word_embeddings=True, query_pre_attn_scalar=8,
                              sliding_window=4, layer_types=['sliding_attention',
                                                             'full_attention']),
}
SIZES = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=24, head_dim=4, vocab_size=len(VOCAB), max_position_embeddings=64,
             rms_norm_eps=1e-6, dtype='float32')


def _models(tmp_path, family: dict) -> tuple[DecoderConfig, dict, list[dict], list[str]]:
  """(config, θ0, three fine-tuned params, [base dir, model dirs...]) of a tiny decoder."""
  config = DecoderConfig.from_hf({**SIZES, **family})
  one = np.ones((1, 1), np.int32)
  theta0 = decoder.Decoder(config).init(jax.random.PRNGKey(0), one, one, one > 0)['params']
  theta0 = jax.tree.map(np.asarray, theta0)
  rng = np.random.default_rng(1)
  tuned = [jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(np.float32),
                        theta0) for _ in range(3)]
  paths = []
  for name, params in [('base', theta0)] + [(f'model{i}', p) for i, p in enumerate(tuned)]:
    directory = str(tmp_path / name)
    hf_decoder.export(params, config, directory)
    write_tokenizer(directory)
    paths.append(directory)
  return config, theta0, tuned, paths


def _windows(base: str) -> calibrated.Calibration:
  data = calibrated.windows(Tokenizer.from_directory(base), DOCUMENTS, LENGTH, 100, 'documents')
  assert data.mask.all() and data.tokens.shape == (8, LENGTH)  # whole windows, as the
  return data                                                 # in-memory merge reads them


def _packed(data: calibrated.Calibration) -> np.ndarray:
  """The windows as the text suite's packed inputs (rows, channels, length)."""
  packed = np.zeros((data.tokens.shape[0], 4, LENGTH), np.int32)
  packed[:, text_finetune.TOKENS] = data.tokens
  packed[:, text_finetune.POSITIONS] = np.arange(LENGTH)
  packed[:, text_finetune.MASK] = data.mask
  return packed


@pytest.mark.parametrize('family', list(FAMILIES))
@pytest.mark.parametrize('method', calibrated.METHODS)
def test_streamed_equals_in_memory(tmp_path, family, method):
  config, theta0, tuned, (base, *models) = _models(tmp_path, FAMILIES[family])
  data = _windows(base)
  output = str(tmp_path / 'merged')
  # Batches of 3 windows: the last batch of 8 is padded with masked rows.
  plan = plan_lib.Plan(method, {'alpha': 0.8, 'batch_size': 3})
  job.merge(base, models, output, plan, calibration=data)
  _, streamed = hf_decoder.load(output)

  vectors = [TaskVector.from_params(theta0, p, task=f't{i}', regime='full')
             for i, p in enumerate(tuned)]
  apply_fn = text_finetune.apply_fn(config)
  task_data = {f't{i}': common.TaskData(None, _packed(data)) for i in range(3)}
  merge = regmean.merge if method == 'regmean' else regmean_plusplus.merge
  in_memory = merge(vectors, theta0=theta0, apply_fn=apply_fn, data=task_data, alpha=0.8,
                    batch_size=64).apply_to(theta0)
  flat_streamed, flat_memory = tree_lib.flatten(streamed), tree_lib.flatten(in_memory)
  assert flat_streamed.keys() == flat_memory.keys()
  for path, value in flat_memory.items():
    np.testing.assert_allclose(flat_streamed[path], value, rtol=2e-4, atol=2e-5, err_msg=path)
  # Not the mean: the Grams moved the linear layers, and only them.
  mean = tree_lib.flatten(jax.tree.map(lambda *x: np.mean(x, axis=0), *tuned))
  assert not np.allclose(flat_streamed['blocks_1/mlp/down/kernel'],
                         mean['blocks_1/mlp/down/kernel'], atol=1e-3)
  np.testing.assert_allclose(flat_streamed['blocks_1/input_norm/scale'],
                             mean['blocks_1/input_norm/scale'], rtol=1e-6)


def test_matrix_merges_of_checkpoints_equal_the_suites(tmp_path):
  """A decoder's fine-tunes merged by Iso-CTS as checkpoints (each layer as transformers holds
  it) and their task vectors merged as the text suite merges them (flax kernels, whose query
  kernels have no bias) give one model: both read every layer as the same matrix
  (`merging.ops.matrices`, which every SVD-era merge reads)."""
  method = 'iso_cts'
  _, theta0, tuned, (base, *models) = _models(tmp_path, FAMILIES['llama, untied head'])
  output = str(tmp_path / 'merged')
  job.merge(base, models, output, plan_lib.Plan(method, {}, scale=0.5))
  _, streamed = hf_decoder.load(output)
  vectors = [TaskVector.from_params(theta0, p, task=f't{i}', regime='full')
             for i, p in enumerate(tuned)]
  in_memory = merging.get(method).merge(vectors).apply_to(theta0, 0.5)
  flat_streamed, flat_memory = tree_lib.flatten(streamed), tree_lib.flatten(in_memory)
  assert flat_streamed.keys() == flat_memory.keys()
  for path, value in flat_memory.items():
    np.testing.assert_allclose(flat_streamed[path], value, rtol=1e-5, atol=1e-6, err_msg=path)


def test_regmean_minimises_each_layers_regression_loss(tmp_path):
  """W_m = argmin Σ_t ‖X_t W − X_t W_t‖² at α = 1: the loss, over the inputs of the first
  block's query layer (the same for every model: the embedding's windows, normed), is higher at
  any nudge of W_m, and than at the mean."""
  config, _, tuned, (base, *models) = _models(tmp_path, FAMILIES['llama, untied head'])
  data = _windows(base)
  output = str(tmp_path / 'merged')
  job.merge(base, models, output, plan_lib.Plan('regmean', {'alpha': 1.0}), calibration=data)
  merged = tree_lib.flatten(hf_decoder.load(output)[1])['blocks_0/attn/query/kernel']
  merged = merged.reshape(SIZES['hidden_size'], -1)

  def inputs(params):  # RMSNorm(E[tokens]) · w, numpy
    x = params['embed']['embedding'][data.tokens].reshape(-1, SIZES['hidden_size'])
    x = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + SIZES['rms_norm_eps'])
    return x * params['blocks_0']['input_norm']['scale']

  pairs = [(inputs(p), p['blocks_0']['attn']['query']['kernel'].reshape(
      SIZES['hidden_size'], -1)) for p in tuned]
  loss = lambda w: sum(np.sum((x @ w - x @ w_t)**2) for x, w_t in pairs)
  rng = np.random.default_rng(0)
  for _ in range(5):
    assert loss(merged) < loss(merged + 1e-2 * rng.standard_normal(merged.shape))
  assert loss(merged) < loss(np.mean([w for _, w in pairs], axis=0))


def test_refusals(tmp_path):
  _, _, _, (base, *models) = _models(tmp_path, FAMILIES['llama, untied head'])
  data = _windows(base)
  output = str(tmp_path / 'merged')
  with pytest.raises(UserError, match='give config.calibration.file'):
    job.merge(base, models, output, plan_lib.Plan('regmean', {}))
  with pytest.raises(UserError, match='config.method = ties reads none'):
    job.merge(base, models, output, plan_lib.Plan('ties', {}), calibration=data)
  with pytest.raises(UserError, match='not with config.slices or config.tokenizer'):
    job.merge(base, models, output, plan_lib.Plan('regmean', {}), calibration=data,
              tokenizer='union')
  empty = tmp_path / 'empty.txt'
  empty.write_text('')
  with pytest.raises(UserError, match='empty.txt'):
    calibrated.read({'file': str(empty), 'field': 'text', 'length': 8, 'windows': 4}, base)
  assert not os.path.exists(output) and not os.path.exists(output + '.partial')


def test_a_killed_merge_resumes_to_the_same_bits(tmp_path, monkeypatch):
  """Shards of one layer each: a merge stopped in its last layer resumes from its finished
  shards, and writes what an uninterrupted merge writes."""
  _, _, _, (base, *models) = _models(tmp_path, FAMILIES['llama, untied head'])
  data = _windows(base)
  plan = plan_lib.Plan('regmean_plusplus', {'batch_size': 4}, shard_bytes=4096)
  whole = str(tmp_path / 'whole')
  job.merge(base, models, whole, plan, calibration=data)
  make = calibrated.LayerMerge._make  # pylint: disable=protected-access

  def stopped(self, stage):
    if stage == self.config.num_layers:
      raise KeyboardInterrupt
    return make(self, stage)

  monkeypatch.setattr(calibrated.LayerMerge, '_make', stopped)
  resumed = str(tmp_path / 'resumed')
  with pytest.raises(KeyboardInterrupt):
    job.merge(base, models, resumed, plan, calibration=data)
  finished = [f for f in os.listdir(resumed + '.partial') if f.endswith('.safetensors')]
  assert finished
  monkeypatch.setattr(calibrated.LayerMerge, '_make', make)
  job.merge(base, models, resumed, plan, calibration=data)
  for name in sorted(os.listdir(whole)):
    if name.endswith('.safetensors') or name.endswith('.json'):
      with open(os.path.join(whole, name), 'rb') as a, \
          open(os.path.join(resumed, name), 'rb') as b:
        assert a.read() == b.read(), name
