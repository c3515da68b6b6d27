"""Hugging Face checkpoints: CLIP's towers in and out, against transformers' PyTorch model
on tiny random configs the tests build and save."""

import hashlib
import json
import os

import jax
import ml_collections
import numpy as np
import pytest
import torch
import transformers

from editing import tree as tree_lib
from editing.errors import UserError
from editing.models import clip_text
from editing.models import hf
from editing.models import vit
from third_party import hf_clip
from third_party import hf_vit

CONFIG = dict(hidden_size=32, intermediate_size=64, projection_dim=16, num_hidden_layers=2,
              num_attention_heads=4, image_size=32, patch_size=8, hidden_act='quick_gelu',
              layer_norm_eps=1e-5)


def random_model(model_class, config):
  """A model of random weights, every tensor perturbed from its initialisation, so that a
  LayerNorm's ones and zeros cannot hide a wrong mapping."""
  torch.manual_seed(0)
  model = model_class(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model


def clip_vision(directory, *, dtype=torch.float32, **save_options):
  """A random CLIPVisionModelWithProjection saved to `directory`."""
  model = random_model(transformers.CLIPVisionModelWithProjection,
                       transformers.CLIPVisionConfig(**CONFIG)).to(dtype)
  model.save_pretrained(directory, **save_options)
  return model


def images(n=3):
  return np.random.default_rng(0).uniform(size=(n, 32, 32, 3)).astype(np.float32)


def theirs(model, x):
  pixels = (x - np.asarray(hf_clip.PIXEL_MEAN, np.float32)) / np.asarray(hf_clip.PIXEL_STD,
                                                                          np.float32)
  with torch.no_grad():
    out = model(pixel_values=torch.from_numpy(pixels.transpose(0, 3, 1, 2)).to(model.dtype))
  return out.last_hidden_state.float().numpy(), out.image_embeds.float().numpy()


def ours(params, model, x):
  module = vit.build(ml_collections.ConfigDict(model))
  with jax.default_matmul_precision('highest'):
    embeds, state = module.apply({'params': params}, x, mutable=['intermediates'])
  return np.asarray(state['intermediates']['hidden'][0]), np.asarray(embeds)


def unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize('sharded', [False, True])
def test_clip_vision_tower_matches_transformers(tmp_path, sharded):
  options = dict(max_shard_size='20KB') if sharded else {}
  model = clip_vision(tmp_path, **options)
  assert os.path.exists(tmp_path / hf.INDEX) == sharded
  params, config = hf.load(str(tmp_path), 'clip_vision')
  assert config['activation'] == 'quick_gelu' and config['layer_norm_epsilon'] == 1e-5
  hidden, embeds = ours(params, config, images())
  their_hidden, their_embeds = theirs(model, images())
  assert np.abs(hidden - their_hidden).max() < 1e-4
  assert np.abs(unit(embeds) - unit(their_embeds)).max() < 1e-5


def test_bf16_weights_are_read_as_stored_and_cast(tmp_path):
  clip_vision(tmp_path, dtype=torch.bfloat16)
  stored = hf.Checkpoint(str(tmp_path)).tensor('vision_model.pre_layrnorm.weight')
  assert stored.dtype.name == 'bfloat16'
  params, config = hf.load(str(tmp_path), 'clip_vision')
  assert params['ln_pre']['scale'].dtype == np.float32
  np.testing.assert_array_equal(params['ln_pre']['scale'], stored.astype(np.float32))
  assert config['dtype'] == 'float32'


def test_a_range_read_stays_inside_its_tensor_and_its_buffer(tmp_path):
  hf.save(str(tmp_path), {'a': np.arange(6, dtype=np.float32), 'b': np.ones(4, np.float32)},
          {'model_type': 'test'}, shard_bytes=2**20)
  ckpt = hf.Checkpoint(str(tmp_path))
  np.testing.assert_array_equal(ckpt.read('a', 2, 5), [2, 3, 4])
  with pytest.raises(ValueError, match=r'a: entries \[4, 8\) of a tensor of 6'):
    ckpt.read('a', 4, 8)  # would run into b's bytes
  with pytest.raises(ValueError, match=r'a: read into float16\[3\], not float32\[3\]'):
    ckpt.read('a', 0, 3, out=np.empty(3, np.float16))


def tensor_digests(directory):
  ckpt = hf.Checkpoint(str(directory))
  return {n: hashlib.sha256(np.ascontiguousarray(ckpt.tensor(n)).tobytes()).hexdigest()
          for n in ckpt.files}


def test_import_then_export_is_bit_identical_and_transformers_loads_it(tmp_path):
  model = clip_vision(tmp_path / 'in')
  params, config = hf.load(str(tmp_path / 'in'), 'clip_vision')
  hf.export(str(tmp_path / 'out'), params, config, 'clip_vision', shard_bytes=30_000)
  assert os.path.exists(tmp_path / 'out' / hf.INDEX)
  assert tensor_digests(tmp_path / 'out') == tensor_digests(tmp_path / 'in')
  reloaded = transformers.CLIPVisionModelWithProjection.from_pretrained(tmp_path / 'out').eval()
  for a, b in zip(theirs(reloaded, images()), theirs(model, images())):
    np.testing.assert_array_equal(a, b)
  again, _ = hf.load(str(tmp_path / 'out'), 'clip_vision')
  for path, leaf in tree_lib.flatten(params).items():
    np.testing.assert_array_equal(tree_lib.flatten(again)[path], leaf)


def snapshot(directory):
  return {f: hashlib.sha256(open(os.path.join(directory, f), 'rb').read()).hexdigest()
          for f in sorted(os.listdir(directory))}


def truncate(directory):
  path = os.path.join(directory, hf.SINGLE)
  data = open(path, 'rb').read()
  open(path, 'wb').write(data[:len(data) - 100])


def drop_a_shard(directory):
  os.remove(os.path.join(directory, sorted(f for f in os.listdir(directory)
                                           if f.startswith('model-'))[0]))


def to_pickle(directory):
  """The PyTorch-pickle form of the same checkpoint (transformers 5 saves only safetensors)."""
  path = os.path.join(directory, hf.SINGLE)
  tensors = {n: torch.from_numpy(hf.Checkpoint(directory).tensor(n).copy())
             for n in hf.Checkpoint(directory).files}
  torch.save(tensors, os.path.join(directory, 'pytorch_model.bin'))
  os.remove(path)


def widen(directory):
  path = os.path.join(directory, 'config.json')
  with open(path) as f:
    config = json.load(f)
  config['intermediate_size'] = 48
  with open(path, 'w') as f:
    json.dump(config, f)


BAD = {
    'truncated': (dict(), truncate, r'model.safetensors is not a readable safetensors file'),
    'missing shard': (dict(max_shard_size='20KB'), drop_a_shard,
                      r'index.json names shard\(s\) \[.model-00001-of-'),
    'wrong shape': (dict(), widen, r'layers.0.mlp.fc1.weight has shape \(64, 32\), the model '
                                   r'\(48, 32\)'),
    'pickle': (dict(), to_pickle,
               r'only pickled weights \(pytorch_model.bin\).*never unpickled.*safetensors'),
}


@pytest.mark.parametrize('case', sorted(BAD))
def test_bad_checkpoints_are_named_and_nothing_is_written(tmp_path, case):
  options, corrupt, message = BAD[case]
  clip_vision(tmp_path, **options)
  corrupt(str(tmp_path))
  before = snapshot(tmp_path)
  with pytest.raises(UserError, match=message):
    hf.load(str(tmp_path), 'clip_vision')
  assert snapshot(tmp_path) == before


def test_a_missing_or_unexpected_tensor_is_named_with_all_the_others(tmp_path):
  clip_vision(tmp_path)
  ckpt = hf.Checkpoint(str(tmp_path))
  tensors = {n: ckpt.tensor(n) for n in ckpt.files}
  del tensors['vision_model.post_layernorm.bias']
  tensors['vision_model.encoder.layers.7.extra'] = np.zeros(3, np.float32)
  hf.save(str(tmp_path / 'edited'), tensors, ckpt.config, shard_bytes=10**9)
  with pytest.raises(UserError, match=r'missing vision_model.post_layernorm.bias; unexpected '
                                      r'vision_model.encoder.layers.7.extra'):
    hf.load(str(tmp_path / 'edited'), 'clip_vision')


TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=64, projection_dim=16,
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
            hidden_act='quick_gelu', layer_norm_eps=1e-5, eos_token_id=98, pad_token_id=1)


def test_clip_text_tower_matches_transformers_and_exports_bit_identically(tmp_path):
  model = random_model(transformers.CLIPTextModelWithProjection,
                       transformers.CLIPTextConfig(**TEXT))
  model.save_pretrained(tmp_path / 'in')
  params, config = hf.load(str(tmp_path / 'in'), 'clip_text')
  rng = np.random.default_rng(0)
  lengths = np.array([3, 16, 9])
  ids = rng.integers(2, 98, (3, 16)).astype(np.int32)
  ids[np.arange(3), lengths - 1] = 98  # the end-of-text token closes each text
  mask = (np.arange(16)[None] < lengths[:, None]).astype(np.int32)
  ids = np.where(mask, ids, 1)
  module = clip_text.build(ml_collections.ConfigDict(config))
  with jax.default_matmul_precision('highest'):
    embeds, state = module.apply({'params': params}, ids, mask, mutable=['intermediates'])
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(ids).long(),
                attention_mask=torch.from_numpy(mask).long())
  hidden = np.asarray(state['intermediates']['hidden'][0])
  real = mask.astype(bool)
  assert np.abs(hidden - out.last_hidden_state.numpy())[real].max() < 1e-4
  assert np.abs(unit(np.asarray(embeds)) - unit(out.text_embeds.numpy())).max() < 1e-5
  hf.export(str(tmp_path / 'out'), params, config, 'clip_text')
  assert tensor_digests(tmp_path / 'out') == {
      n: h for n, h in tensor_digests(tmp_path / 'in').items() if n not in hf_clip.TEXT_IGNORED}
  reloaded = transformers.CLIPTextModelWithProjection.from_pretrained(tmp_path / 'out').eval()
  with torch.no_grad():
    again = reloaded(input_ids=torch.from_numpy(ids).long(),
                     attention_mask=torch.from_numpy(mask).long())
  np.testing.assert_array_equal(again.text_embeds.numpy(), out.text_embeds.numpy())


def clip_model():
  """A random CLIPModel with the tiny vision (CONFIG) and text (TEXT) towers, seeded."""
  torch.manual_seed(0)
  return transformers.CLIPModel(transformers.CLIPConfig(
      text_config=TEXT, vision_config=CONFIG, projection_dim=16)).eval()


def test_a_clip_model_checkpoint_gives_both_towers(tmp_path):
  model = clip_model()
  model.save_pretrained(tmp_path)
  vision, vision_config = hf.load(str(tmp_path), 'clip_vision')
  text_params, text_config = hf.load(str(tmp_path), 'clip_text')
  assert vision_config['embed_dim'] == text_config['embed_dim'] == 16
  assert 'proj' in vision and 'proj' in text_params
  scale = hf.Checkpoint(str(tmp_path)).tensor('logit_scale')
  np.testing.assert_allclose(np.exp(scale), model.logit_scale.exp().item(), rtol=1e-6)


VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           image_size=32, patch_size=8)


def vit_pixels(x, mean, std):
  pixels = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
  return torch.from_numpy(pixels.transpose(0, 3, 1, 2))


def test_vit_model_with_its_pooler_matches_transformers_and_exports_bit_identically(tmp_path):
  model = random_model(transformers.ViTModel, transformers.ViTConfig(**VIT))
  model.save_pretrained(tmp_path / 'in')
  params, config = hf.load(str(tmp_path / 'in'), 'vit')
  assert config['pooler'] and not config['pre_norm'] and config['patch_bias']
  assert config['activation'] == 'gelu' and config['layer_norm_epsilon'] == 1e-12
  assert config['pixel_mean'] == list(hf_vit.PIXEL_MEAN)
  hidden, pooled = ours(params, config, images())
  with torch.no_grad():
    out = model(pixel_values=vit_pixels(images(), hf_vit.PIXEL_MEAN, hf_vit.PIXEL_STD),
                output_hidden_states=True)
  # Our sown states are the last block's output, before the final LayerNorm.
  assert np.abs(hidden - out.hidden_states[-1].numpy()).max() < 1e-4
  assert np.abs(pooled - out.pooler_output.numpy()).max() < 1e-5
  hf.export(str(tmp_path / 'out'), params, config, 'vit')
  assert tensor_digests(tmp_path / 'out') == tensor_digests(tmp_path / 'in')
  reloaded = transformers.ViTModel.from_pretrained(tmp_path / 'out').eval()
  with torch.no_grad():
    again = reloaded(pixel_values=vit_pixels(images(), hf_vit.PIXEL_MEAN, hf_vit.PIXEL_STD))
  np.testing.assert_array_equal(again.pooler_output.numpy(), out.pooler_output.numpy())
  assert hf.load(str(tmp_path / 'out'), 'vit')[1] == config


def test_a_vit_classifier_gives_its_encoder_with_the_preprocessors_statistics(tmp_path):
  model = random_model(transformers.ViTForImageClassification,
                       transformers.ViTConfig(num_labels=5, **VIT))
  model.save_pretrained(tmp_path)
  mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
  with open(tmp_path / 'preprocessor_config.json', 'w') as f:
    json.dump({'image_mean': mean, 'image_std': std}, f)
  params, config = hf.load(str(tmp_path), 'vit')
  assert not config['pooler'] and 'pooler' not in params and 'classifier' not in params
  assert config['pixel_mean'] == mean and config['pixel_std'] == std
  _, embeds = ours(params, config, images())
  with torch.no_grad():
    out = model.vit(pixel_values=vit_pixels(images(), mean, std))
  assert np.abs(embeds - out.last_hidden_state[:, 0].numpy()).max() < 1e-4
