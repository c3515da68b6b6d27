"""PEFT LoRA adapters in and out, against peft itself: tiny random CLIP and BERT models that the
tests build, adapters peft saves, read here, applied, written back and loaded by peft again."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers

from editing import safetensors_io
from editing import tree as tree_lib
from editing.errors import UserError
from editing.lora import LowRank
from editing.models import hf
from editing.models import peft_adapter
from editing.task_vector import TaskVector
from merging.checkpoints import job
from merging.checkpoints import plan as plan_lib
from tests import test_bert
from tests import test_hf

peft = pytest.importorskip('peft')


def adapted(model, directory, **lora):
  """`model` with a LoRA adapter of random factors (B too, so that it changes the outputs),
  saved by peft into `directory`."""
  config = peft.LoraConfig(**lora)
  wrapped = peft.get_peft_model(model, config)
  torch.manual_seed(1)
  with torch.no_grad():
    for name, p in wrapped.named_parameters():
      if 'lora_' in name:
        p.copy_(0.2 * torch.randn_like(p))
  wrapped.eval()
  wrapped.save_pretrained(directory)
  return wrapped


def clip_setup(tmp_path, **lora):
  base = test_hf.clip_vision(tmp_path / 'base')
  params, model = hf.load(str(tmp_path / 'base'), 'clip_vision')
  peft_model = adapted(base, tmp_path / 'adapter', **lora)
  return params, model, peft_model


def clip_outputs(peft_model, params, model, vector):
  theirs = test_hf.theirs(peft_model, test_hf.images())
  ours = test_hf.ours(vector.apply_to(params), model, test_hf.images())
  return theirs, ours


def assert_same_factors(original_dir, written_dir):
  """The two adapters hold the same factors under the same names, bit for bit."""
  original, _ = safetensors_io.load(str(original_dir / peft_adapter.ADAPTER))
  written, _ = safetensors_io.load(str(written_dir / peft_adapter.ADAPTER))
  assert written.keys() == original.keys()
  for name in original:
    np.testing.assert_array_equal(written[name].view(np.uint32), original[name].view(np.uint32),
                                  err_msg=name)


@pytest.mark.parametrize('lora', [
    dict(r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj']),
    dict(r=4, lora_alpha=8, use_rslora=True, target_modules=['q_proj', 'k_proj', 'v_proj',
                                                             'out_proj', 'fc1']),
    dict(r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj'], rank_pattern={'v_proj': 2},
         alpha_pattern={'v_proj': 6})])
def test_a_clip_adapter_reads_as_peft_applies_it_and_writes_back_bit_identical(tmp_path, lora):
  params, model, peft_model = clip_setup(tmp_path, **lora)
  family = hf.FAMILIES['clip_vision']
  vector = peft_adapter.read(str(tmp_path / 'adapter'), family, model, params)
  assert vector.low_rank and vector.regime == 'lora'
  (their_hidden, their_embeds), (hidden, embeds) = clip_outputs(peft_model, params, model, vector)
  assert np.abs(hidden - their_hidden).max() < 1e-4
  assert np.abs(test_hf.unit(embeds) - test_hf.unit(their_embeds)).max() < 1e-5
  # Written back: the same factors, bit for bit, and peft loads it to the same model.
  peft_adapter.write(str(tmp_path / 'out'), vector, family, model)
  assert_same_factors(tmp_path / 'adapter', tmp_path / 'out')
  reloaded = peft.PeftModel.from_pretrained(test_hf.clip_vision(tmp_path / 'base2'),
                                            str(tmp_path / 'out')).eval()
  again = test_hf.theirs(reloaded, test_hf.images())
  np.testing.assert_allclose(again[1], their_embeds, rtol=1e-5, atol=1e-6)


def test_a_bert_adapter_reads_as_peft_applies_it(tmp_path):
  base = test_hf.random_model(transformers.BertModel, transformers.BertConfig(**test_bert.CONFIG))
  base.save_pretrained(tmp_path / 'base')
  params, model = hf.load(str(tmp_path / 'base'), 'bert')
  peft_model = adapted(base, tmp_path / 'adapter', r=2, lora_alpha=4,
                       target_modules=['query', 'value', 'attention.output.dense'])
  vector = peft_adapter.read(str(tmp_path / 'adapter'), hf.FAMILIES['bert'], model, params)
  assert len(vector.delta) == 3 * test_bert.CONFIG['num_hidden_layers']
  batch = test_bert.random_batch()
  with torch.no_grad():
    out = peft_model(**{k: torch.from_numpy(v).long() for k, v in batch.items()})
  hidden, pooled = test_bert.ours(vector.apply_to(params), model, batch, 'pooler')
  mask = batch['attention_mask'].astype(bool)
  assert np.abs(hidden - out.last_hidden_state.numpy())[mask].max() < 1e-4
  assert np.abs(test_bert.unit(pooled) - test_bert.unit(out.pooler_output.numpy())).max() < 1e-5


def test_a_lora_task_vector_written_here_loads_in_peft(tmp_path):
  """A vector made here (a sum of two adapters: rank 8, scale 1) as peft sees it."""
  base = test_hf.clip_vision(tmp_path / 'base')
  params, model = hf.load(str(tmp_path / 'base'), 'clip_vision')
  rng = np.random.default_rng(0)
  width = model['width']
  paths = [f'blocks_{i}/attn/{p}/kernel' for i in range(model['depth']) for p in ('query', 'out')]
  shapes = {p: np.shape(tree_lib.flatten(params)[p]) for p in paths}
  make = lambda: TaskVector(
      {p: LowRank(rng.normal(size=(width, 4)).astype(np.float32) * 0.1,
                  rng.normal(size=(4, width)).astype(np.float32), np.float32(0.5), shapes[p])
       for p in paths}, ('t',), 'lora', 'b')
  vector = make() + make()
  peft_adapter.write(str(tmp_path / 'out'), vector, hf.FAMILIES['clip_vision'], model)
  with open(tmp_path / 'out' / peft_adapter.CONFIG) as f:
    assert json.load(f)['r'] == 8
  loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / 'out')).eval()
  theirs = test_hf.theirs(loaded, test_hf.images())
  ours = test_hf.ours(vector.apply_to(params), model, test_hf.images())
  assert np.abs(test_hf.unit(ours[1]) - test_hf.unit(theirs[1])).max() < 1e-5


def edit_config(directory, **changes):
  path = os.path.join(directory, peft_adapter.CONFIG)
  with open(path) as f:
    config = json.load(f)
  config.update(changes)
  with open(path, 'w') as f:
    json.dump(config, f)


def test_bad_adapters_are_named_and_nothing_is_written(tmp_path):
  params, model, _ = clip_setup(tmp_path, r=4, lora_alpha=8, target_modules=['q_proj'])
  family = hf.FAMILIES['clip_vision']
  source = tmp_path / 'adapter'

  def read(case, **changes):
    directory = tmp_path / case
    shutil.copytree(source, directory)
    edit_config(directory, **changes)
    return directory

  for case, changes, message in (
      ('dora', dict(use_dora=True), 'sets use_dora: DoRA is not read'),
      ('bias', dict(lora_bias=True), 'sets lora_bias: LoRA biases'),
      ('saved', dict(modules_to_save=['post_layernorm']), r"modules_to_save \['post_layernorm'\]"),
      ('prefix', dict(peft_type='PREFIX_TUNING'), 'a PREFIX_TUNING adapter'),
      ('rank', dict(r=3), 'has rank 4, its config says 3')):
    with pytest.raises(UserError, match=message):
      peft_adapter.read(str(read(case, **changes)), family, model, params)
  narrower, narrow_model = hf.load(str(tmp_path / 'base'), 'clip_vision')
  narrow_model = dict(narrow_model, depth=1)
  wider = tmp_path / 'wider'
  shutil.copytree(source, wider)
  tensors, metadata = safetensors_io.load(str(wider / peft_adapter.ADAPTER))
  name = next(n for n in tensors if n.endswith('lora_A.weight'))
  tensors[name] = np.zeros((4, 48), np.float32)
  safetensors_io.save(str(wider / peft_adapter.ADAPTER), tensors, metadata)
  with pytest.raises(UserError, match=r'an adapter for another base'):
    peft_adapter.read(str(wider), family, model, params)
  with pytest.raises(UserError, match='is not a linear layer of a'):
    peft_adapter.read(str(source), family, narrow_model, narrower)
  pickled = tmp_path / 'pickled'
  pickled.mkdir()
  (pickled / 'adapter_model.bin').write_bytes(b'\x80\x04')
  with pytest.raises(UserError, match='adapter_model.bin is a pickle'):
    peft_adapter.read(str(pickled), family, model, params)
  # An adapter written for one base is refused on another.
  vector = peft_adapter.read(str(source), family, model, params)
  peft_adapter.write(str(tmp_path / 'stamped'), vector, family, model, theta0=params)
  other = {**params, 'proj': {'kernel': params['proj']['kernel'] + 1}}
  with pytest.raises(UserError, match='was written for the base'):
    peft_adapter.read(str(tmp_path / 'stamped'), family, model, other)
  with pytest.raises(UserError, match='a dense task vector'):
    peft_adapter.write(str(tmp_path / 'dense'), TaskVector.from_params(
        params, params, task='t', regime='full'), family, model)
  assert not os.path.exists(tmp_path / 'dense')


def two_adapters(tmp_path):
  """A base CLIP tower on disk and two peft adapters over it (of different ranks)."""
  test_hf.clip_vision(tmp_path / 'base')
  models = []
  for i, (rank, targets) in enumerate(((4, ['q_proj', 'v_proj']), (2, ['q_proj', 'v_proj']))):
    torch.manual_seed(10 + i)
    adapted(test_hf.clip_vision(tmp_path / f'base{i}'), tmp_path / f'adapter{i}', r=rank,
            lora_alpha=8, target_modules=targets)
    models.append(str(tmp_path / f'adapter{i}'))
  return str(tmp_path / 'base'), models


def merged_weights(base, adapter):
  """peft's own merge_and_unload of `adapter` over the model at `base`: {name: weight}."""
  model = peft.PeftModel.from_pretrained(
      transformers.CLIPVisionModelWithProjection.from_pretrained(base), adapter)
  return {k: v.detach().numpy() for k, v in model.merge_and_unload().state_dict().items()}


def test_checkpoint_merges_take_adapters_as_their_fine_tuned_models(tmp_path):
  base, models = two_adapters(tmp_path)
  plan = plan_lib.Plan('task_arithmetic', {}, scale=0.5)
  job.merge(base, models, str(tmp_path / 'merged'), plan)
  merged = hf.Checkpoint(str(tmp_path / 'merged'))
  original = hf.Checkpoint(base)
  tuned = [merged_weights(base, m) for m in models]
  for name in original.files:
    expected = original.tensor(name) + 0.5 * sum(t[name] - original.tensor(name) for t in tuned)
    np.testing.assert_allclose(merged.tensor(name), expected, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_a_lora_space_checkpoint_merge_writes_an_adapter_peft_loads(tmp_path):
  base, models = two_adapters(tmp_path)
  plan = plan_lib.Plan('peft_cat', {}, weights=(1.0, -0.5))
  summary = job.merge(base, models, str(tmp_path / 'cat'), plan)
  assert set(summary['adapter']['ranks'].values()) == {6}  # ranks 4 + 2, concatenated
  original = hf.Checkpoint(base)
  tuned = [merged_weights(base, m) for m in models]
  loaded = merged_weights(base, str(tmp_path / 'cat'))
  for name in original.files:
    expected = original.tensor(name) + (tuned[0][name] - original.tensor(name)) \
        - 0.5 * (tuned[1][name] - original.tensor(name))
    np.testing.assert_allclose(loaded[name], expected, rtol=1e-5, atol=1e-5, err_msg=name)
  job.merge(base, models, str(tmp_path / 'knots'), plan_lib.Plan('knots_ties', {}))
  assert os.path.isfile(tmp_path / 'knots' / peft_adapter.CONFIG)
  with pytest.raises(UserError, match=r"knots_ties merges PEFT LoRA adapters, and \[.*base'"
                                      r"\] hold no adapter_config.json"):
    job.merge(base, [models[0], base], str(tmp_path / 'mixed'), plan_lib.Plan('knots_ties', {}))
  assert not os.path.exists(tmp_path / 'mixed')
  with pytest.raises(UserError, match='peft_linear: .* has adapters of ranks'):
    job.merge(base, models, str(tmp_path / 'linear'), plan_lib.Plan('peft_linear', {}))
  assert not os.path.exists(tmp_path / 'linear')


def test_a_checkpoint_merge_refuses_an_adapter_for_another_base_on_both_paths(tmp_path):
  base, models = two_adapters(tmp_path)
  tensors, metadata = safetensors_io.load(os.path.join(models[1], peft_adapter.ADAPTER))
  name = next(n for n in sorted(tensors) if n.endswith('lora_A.weight'))
  tensors[name] = np.zeros((2, tensors[name].shape[1] + 1), np.float32)
  safetensors_io.save(os.path.join(models[1], peft_adapter.ADAPTER), tensors, metadata)
  for method in ('task_arithmetic', 'peft_cat'):  # W + s·B A, and a merge in LoRA space
    with pytest.raises(UserError, match=r'adapter1: the factors of .* make a \d+ × \d+ delta, '
                                        r'and .*base has \(\d+, \d+\): an adapter for another'):
      job.merge(base, models, str(tmp_path / method), plan_lib.Plan(method, {}))
    assert not os.path.exists(tmp_path / method)
