"""A task vector's truncated factors (editing/lora.py), and a fine-tuned checkpoint extracted as
a PEFT LoRA adapter (`extract_lora`) that PEFT loads onto the base model."""

import json
import os

import numpy as np
import pytest

from editing import lora
from editing.errors import UserError
from editing.models import hf
from merging import checkpoints
from merging import svd

DEFAULTS = dict(rank=16, sv_epsilon=0.0, energy=1.0, distribute_scale=True)


def low_rank(rng, shape, rank, scales):
  u = np.linalg.qr(rng.normal(size=(shape[0], rank)))[0]
  v = np.linalg.qr(rng.normal(size=(shape[1], rank)))[0]
  return (u * np.asarray(scales)) @ v.T


def test_factors_rebuild_the_truncated_svd_and_report_the_energy_kept():
  rng = np.random.default_rng(0)
  delta = low_rank(rng, (12, 9), 3, [4.0, 2.0, 1.0]).astype(np.float32)
  exact, energy = lora.factor(delta, **{**DEFAULTS, 'rank': 3})
  np.testing.assert_allclose(exact.b @ exact.a, delta, atol=1e-5)
  assert energy == pytest.approx(1.0) and exact.shape == (9, 12) and exact.scale == 1
  # Σ^½ on each side: the columns of B and the rows of A have the same norms, √σ.
  np.testing.assert_allclose(np.linalg.norm(exact.b, axis=0), np.sqrt([4, 2, 1]), rtol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(exact.a, axis=1), np.sqrt([4, 2, 1]), rtol=1e-5)
  two, energy = lora.factor(delta, **{**DEFAULTS, 'rank': 2})
  assert two.a.shape == (2, 9) and energy == pytest.approx(20 / 21)
  # The fewest singular values holding 95% of σ² = (16, 4, 1): two of them (20/21 ≥ 0.95).
  assert lora.factor(delta, **{**DEFAULTS, 'rank': 3, 'energy': 0.95})[0].rank == 2
  assert lora.factor(delta, **{**DEFAULTS, 'rank': 3, 'sv_epsilon': 1.5})[0].rank == 2
  undistributed, _ = lora.factor(delta, **{**DEFAULTS, 'rank': 3, 'distribute_scale': False})
  np.testing.assert_allclose(np.linalg.norm(undistributed.b, axis=0), 1.0, rtol=1e-5)
  np.testing.assert_allclose(undistributed.b @ undistributed.a, delta, atol=1e-5)


def test_factors_by_a_sketch_rebuild_a_decaying_spectrum_as_the_full_svd_does():
  """σ_i = 2^{-i}: the sketch's l = 26 columns and 2 power iterations miss σ_17 by about
  (σ_27/σ_16)^5 = 2^{-55}, so B A agrees with the full SVD's to float32's rounding; the energy
  kept is Σ_{i≤16} σ_i² over ‖ΔW‖²_F, whose whole the sketch never sees."""
  sigma = 2.0 ** -np.arange(40)
  delta = low_rank(np.random.default_rng(1), (120, 90), 40, sigma).astype(np.float32)
  full, full_energy = lora.factor(delta, **DEFAULTS)
  sketched, energy = lora.factor(delta, **DEFAULTS, top=svd.top_singular)
  np.testing.assert_allclose(sketched.b @ sketched.a, full.b @ full.a, atol=1e-6)
  expected = np.sum(sigma[:16] ** 2) / np.sum(sigma ** 2)
  assert energy == pytest.approx(expected, rel=1e-6)
  assert full_energy == pytest.approx(expected, rel=1e-6)
  # The energy cut reads only the top `rank` values: 0.99 of σ² = 4^{-i} is in the first 4.
  assert lora.factor(delta, **{**DEFAULTS, 'energy': 0.99}, top=svd.top_singular)[0].rank == 4


def test_a_rank_above_the_matrix_is_refused_naming_it():
  with pytest.raises(UserError, match=r'q_proj.weight: rank 5 exceeds the matrix \(4, 3\)'):
    lora.factor(np.zeros((4, 3), np.float32), **{**DEFAULTS, 'rank': 5}, name='q_proj.weight')


def tiny_llama(torch, transformers, seed):
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=40)
  return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize('embed_lora', [False, True], ids=['tables_saved', 'embed_lora'])
def test_an_extracted_adapter_loads_in_peft_and_gives_the_fine_tuned_model(tmp_path,
                                                                          embed_lora):
  """Every matrix of the fine-tune changed at rank 2 (the token table and the head only with
  embed_lora, which factors them: PEFT's embedding LoRA and a linear LoRA), the norms fully."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  peft = pytest.importorskip('peft')
  base = tiny_llama(torch, transformers, 0)
  base.save_pretrained(tmp_path / 'base', safe_serialization=True)
  tuned = tiny_llama(torch, transformers, 0)
  rng = np.random.default_rng(1)
  with torch.no_grad():
    for name, p in tuned.named_parameters():
      tables = 'embed' in name or 'lm_head' in name
      if p.ndim == 2 and (embed_lora or not tables):
        p += torch.tensor(low_rank(rng, tuple(p.shape), 2, [0.3, 0.1]), dtype=p.dtype)
      elif 'norm' in name:
        p += 0.05 * torch.tensor(rng.normal(size=tuple(p.shape)), dtype=p.dtype)
  tuned.save_pretrained(tmp_path / 'tuned', safe_serialization=True)
  out = str(tmp_path / 'adapter')
  summary = checkpoints.merge(str(tmp_path / 'base'), [str(tmp_path / 'tuned')], out,
                              checkpoints.Plan('extract_lora', {'rank': 2,
                                                                'embed_lora': embed_lora}))
  factored = summary['extraction']['modules']
  assert all(m['rank'] == 2 and m['energy'] == pytest.approx(1.0, abs=1e-5)
             for m in factored.values())
  assert ('model.embed_tokens' in factored and 'lm_head' in factored) == embed_lora
  with open(os.path.join(out, 'adapter_config.json')) as f:
    config = json.load(f)
  assert config['r'] == config['lora_alpha'] == 2 and 'model.norm' in config['modules_to_save']
  assert ('model.embed_tokens' in config['modules_to_save']) != embed_lora
  loaded = peft.PeftModel.from_pretrained(
      transformers.LlamaForCausalLM.from_pretrained(tmp_path / 'base'), out).eval()
  ids = torch.tensor([[1, 5, 7, 30, 2, 11]])
  with torch.no_grad():
    expected, got = tuned(ids).logits, loaded(ids).logits
    untouched = base(ids).logits
  assert (expected - untouched).abs().max() > 1e-2  # the fine-tune changed the outputs
  np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-5)


def test_a_changed_bias_is_refused_and_nothing_is_written(tmp_path):
  weights = {'layer.weight': np.ones((4, 3), np.float32), 'layer.bias': np.zeros(4, np.float32)}
  hf.save(str(tmp_path / 'base'), weights, {}, shard_bytes=10**9)
  hf.save(str(tmp_path / 'tuned'), {**weights, 'layer.bias': np.ones(4, np.float32)}, {},
          shard_bytes=10**9)
  with pytest.raises(UserError, match='layer.bias differs from the base.*no place for a '
                                      'changed bias'):
    checkpoints.merge(str(tmp_path / 'base'), [str(tmp_path / 'tuned')],
                      str(tmp_path / 'adapter'), checkpoints.Plan('extract_lora', {'rank': 2}))
  assert sorted(f for f in os.listdir(tmp_path) if not f.endswith('.lock')) == ['base', 'tuned']
