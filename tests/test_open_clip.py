"""open_clip state dicts: a tiny random CLIPModel rewritten in open_clip's layout (q, k, v packed
in in_proj_weight, projections stored transposed) imports to exactly the params of the same
model in Hugging Face's layout, and its packed tensors are rebuilt bit for bit."""

import json

import numpy as np
import pytest
import transformers
from safetensors import numpy as safetensors_np

from configs import clip_8task
from editing import tree as tree_lib
from editing.errors import UserError
from editing.jobs import experiment
from editing.jobs import pretrain
from editing.models import hf
from editing.models import keymap
from tests.test_hf import clip_model
from third_party import open_clip

_LAYER_NAMES = {'layer_norm1': 'ln_1', 'layer_norm2': 'ln_2', 'self_attn.out_proj': 'attn.out_proj',
                'mlp.fc1': 'mlp.c_fc', 'mlp.fc2': 'mlp.c_proj'}


def open_clip_state(state: dict) -> dict:
  """A CLIPModel's state dict renamed and re-laid as open_clip's CLIP holds it."""
  out = {'logit_scale': state['logit_scale']}
  for tower, prefix in (('vision_model', 'visual.'), ('text_model', '')):
    layers = {k for k in state if k.startswith(f'{tower}.encoder.layers.')}
    for i in sorted({int(k.split('.')[3]) for k in layers}):
      theirs, ours = f'{tower}.encoder.layers.{i}.', f'{prefix}transformer.resblocks.{i}.'
      for name, renamed in _LAYER_NAMES.items():
        for p in ('weight', 'bias'):
          out[f'{ours}{renamed}.{p}'] = state[f'{theirs}{name}.{p}']
      for p in ('weight', 'bias'):
        out[f'{ours}attn.in_proj_{p}'] = np.concatenate(
            [state[f'{theirs}self_attn.{x}_proj.{p}'] for x in 'qkv'])
  out.update({
      'visual.class_embedding': state['vision_model.embeddings.class_embedding'],
      'visual.conv1.weight': state['vision_model.embeddings.patch_embedding.weight'],
      'visual.positional_embedding': state['vision_model.embeddings.position_embedding.weight'],
      'visual.ln_pre.weight': state['vision_model.pre_layrnorm.weight'],
      'visual.ln_pre.bias': state['vision_model.pre_layrnorm.bias'],
      'visual.ln_post.weight': state['vision_model.post_layernorm.weight'],
      'visual.ln_post.bias': state['vision_model.post_layernorm.bias'],
      'visual.proj': state['visual_projection.weight'].T.copy(),
      'token_embedding.weight': state['text_model.embeddings.token_embedding.weight'],
      'positional_embedding': state['text_model.embeddings.position_embedding.weight'],
      'ln_final.weight': state['text_model.final_layer_norm.weight'],
      'ln_final.bias': state['text_model.final_layer_norm.bias'],
      'text_projection': state['text_projection.weight'].T.copy(),
  })
  return out


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  """The same random CLIPModel in Hugging Face's layout and in open_clip's."""
  root = tmp_path_factory.mktemp('open_clip')
  model = clip_model()
  model.save_pretrained(root / 'hf')
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  (root / 'oc').mkdir()
  tensors = open_clip_state(state)
  (root / 'oc' / open_clip.WEIGHTS).write_bytes(safetensors_np.save(tensors))
  config = {'model_cfg': {
      'embed_dim': 16, 'quick_gelu': True,
      'vision_cfg': {'image_size': 32, 'layers': 2, 'width': 32, 'patch_size': 8,
                     'head_width': 8, 'mlp_ratio': 2.0},
      'text_cfg': {'context_length': 16, 'vocab_size': 99, 'width': 32, 'heads': 4,
                   'layers': 2, 'mlp_ratio': 2.0}}}
  (root / 'oc' / open_clip.CONFIG).write_text(json.dumps(config))
  return str(root / 'hf'), str(root / 'oc'), tensors


@pytest.mark.parametrize('tower', ['vision', 'text'])
def test_both_layouts_import_to_the_same_params(checkpoints, tower):
  hf_dir, oc_dir, _ = checkpoints
  theirs, their_model = hf.load(hf_dir, f'clip_{tower}')
  ours, our_model = hf.load(oc_dir, f'open_clip_{tower}')
  assert our_model == their_model
  flat = tree_lib.flatten(ours)
  assert flat.keys() == tree_lib.flatten(theirs).keys()
  for path, leaf in tree_lib.flatten(theirs).items():
    np.testing.assert_array_equal(flat[path], leaf, err_msg=path)


def test_packed_tensors_are_rebuilt_bit_for_bit_and_export_is_hugging_faces(checkpoints,
                                                                          tmp_path):
  _, oc_dir, tensors = checkpoints
  params, model = hf.load(oc_dir, 'open_clip_vision')
  rebuilt = keymap.to_theirs(keymap.expand(open_clip.RULES, model['depth']),
                             tree_lib.flatten(params))
  assert rebuilt.keys() == {k for k in tensors if k.startswith('visual.')}
  for name, x in rebuilt.items():
    np.testing.assert_array_equal(x, tensors[name], err_msg=name)
  with pytest.raises(UserError, match='export the same params as clip_vision'):
    hf.export(str(tmp_path / 'out'), params, model, 'open_clip_vision')
  hf.export(str(tmp_path / 'out'), params, model, 'clip_vision')
  transformers.CLIPVisionModelWithProjection.from_pretrained(tmp_path / 'out')


def test_the_8task_jobs_take_open_clip_weights(checkpoints, tmp_path):
  hf_dir, oc_dir, _ = checkpoints
  assert hf.clip_towers(oc_dir) == ('open_clip_vision', 'open_clip_text')
  assert hf.clip_towers(hf_dir) == ('clip_vision', 'clip_text')
  config = clip_8task.get_config('tiny')
  config.weights = oc_dir
  pretrain.run(config, str(tmp_path))
  theta0, _ = experiment.load_pretrained(str(tmp_path))
  theirs, _ = hf.load(hf_dir, 'clip_vision')
  np.testing.assert_array_equal(theta0['blocks_1']['attn']['value']['kernel'],
                                theirs['blocks_1']['attn']['value']['kernel'])
