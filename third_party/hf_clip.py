"""Hugging Face transformers' CLIP towers ↔ editmerge's ViT (`editing/models/vit.py`) and text
transformer (`editing/models/clip_text.py`).

Source: transformers, models/clip/modeling_clip.py (CLIPVisionEmbeddings, CLIPAttention,
CLIPMLP, CLIPEncoderLayer, CLIPVisionTransformer, CLIPVisionModelWithProjection, CLIPModel) and
configuration_clip.py (CLIPVisionConfig). The same tensors sit under `vision_model.` and
`visual_projection.` in CLIPModel, CLIPVisionModel and CLIPVisionModelWithProjection
checkpoints (RULES), the text tower's under `text_model.` and `text_projection.` in CLIPModel,
CLIPTextModel and CLIPTextModelWithProjection (TEXT_RULES). CLIPModel's `logit_scale` (stored
as its log) is neither tower's: read it with `Checkpoint.tensor('logit_scale')`.

Each rule is (our path, their name, layout), `{i}` standing for a block's index; the layouts
are `editing.models.keymap`'s.
"""

# Their activation names -> ours (editing/models/vit.py: ACTIVATIONS).
ACTIVATIONS = {'quick_gelu': 'quick_gelu', 'gelu': 'gelu', 'gelu_new': 'gelu_tanh',
               'gelu_pytorch_tanh': 'gelu_tanh'}
# OpenAI CLIP's preprocessing (its image processor's image_mean and image_std).
PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)
PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)
OWNED_PREFIXES = ('vision_model.', 'visual_projection.')
TEXT_OWNED_PREFIXES = ('text_model.', 'text_projection.')
# Buffers saved beside the weights that are not parameters.
TEXT_IGNORED = ('text_model.embeddings.position_ids',)

_EMBEDDINGS = 'vision_model.embeddings.'
_LAYER = 'vision_model.encoder.layers.{i}.'
RULES = (
    ('class_embedding', _EMBEDDINGS + 'class_embedding', 'copy'),
    ('patch_embed/kernel', _EMBEDDINGS + 'patch_embedding.weight', 'conv'),
    ('position_embedding', _EMBEDDINGS + 'position_embedding.weight', 'copy'),
    ('ln_pre/scale', 'vision_model.pre_layrnorm.weight', 'copy'),
    ('ln_pre/bias', 'vision_model.pre_layrnorm.bias', 'copy'),
    ('blocks_{i}/ln_1/scale', _LAYER + 'layer_norm1.weight', 'copy'),
    ('blocks_{i}/ln_1/bias', _LAYER + 'layer_norm1.bias', 'copy'),
    ('blocks_{i}/attn/query/kernel', _LAYER + 'self_attn.q_proj.weight', 'heads_in'),
    ('blocks_{i}/attn/query/bias', _LAYER + 'self_attn.q_proj.bias', 'heads_bias'),
    ('blocks_{i}/attn/key/kernel', _LAYER + 'self_attn.k_proj.weight', 'heads_in'),
    ('blocks_{i}/attn/key/bias', _LAYER + 'self_attn.k_proj.bias', 'heads_bias'),
    ('blocks_{i}/attn/value/kernel', _LAYER + 'self_attn.v_proj.weight', 'heads_in'),
    ('blocks_{i}/attn/value/bias', _LAYER + 'self_attn.v_proj.bias', 'heads_bias'),
    ('blocks_{i}/attn/out/kernel', _LAYER + 'self_attn.out_proj.weight', 'heads_out'),
    ('blocks_{i}/attn/out/bias', _LAYER + 'self_attn.out_proj.bias', 'copy'),
    ('blocks_{i}/ln_2/scale', _LAYER + 'layer_norm2.weight', 'copy'),
    ('blocks_{i}/ln_2/bias', _LAYER + 'layer_norm2.bias', 'copy'),
    ('blocks_{i}/mlp_fc/kernel', _LAYER + 'mlp.fc1.weight', 'linear'),
    ('blocks_{i}/mlp_fc/bias', _LAYER + 'mlp.fc1.bias', 'copy'),
    ('blocks_{i}/mlp_proj/kernel', _LAYER + 'mlp.fc2.weight', 'linear'),
    ('blocks_{i}/mlp_proj/bias', _LAYER + 'mlp.fc2.bias', 'copy'),
    ('ln_post/scale', 'vision_model.post_layernorm.weight', 'copy'),
    ('ln_post/bias', 'vision_model.post_layernorm.bias', 'copy'),
    ('proj/kernel', 'visual_projection.weight', 'linear'),
)


_TEXT_LAYER = 'text_model.encoder.layers.{i}.'
TEXT_RULES = tuple(
    (ours, theirs.replace(_LAYER, _TEXT_LAYER), layout)
    for ours, theirs, layout in RULES if ours.startswith('blocks_')) + (
    ('token_embedding/embedding', 'text_model.embeddings.token_embedding.weight', 'copy'),
    ('position_embedding/embedding', 'text_model.embeddings.position_embedding.weight', 'copy'),
    ('ln_final/scale', 'text_model.final_layer_norm.weight', 'copy'),
    ('ln_final/bias', 'text_model.final_layer_norm.bias', 'copy'),
    ('proj/kernel', 'text_projection.weight', 'linear'),
)


def vision_config(config: dict) -> dict:
  """The vision part of a config.json: CLIPModel's `vision_config`, or the whole file."""
  vision = config.get('vision_config', config)
  return dict(vision, projection_dim=vision.get('projection_dim', config.get('projection_dim')))


def model_config(config: dict, *, with_projection: bool) -> dict:
  """Our `config.model` (editing/models/vit.py) from their config.json."""
  vision = vision_config(config)
  act = vision.get('hidden_act', 'quick_gelu')
  if act not in ACTIVATIONS:
    raise ValueError(f'hidden_act {act!r} has no counterpart here; known: {sorted(ACTIVATIONS)}')
  return {'family': 'vit', 'patch_size': vision['patch_size'], 'width': vision['hidden_size'],
          'depth': vision['num_hidden_layers'], 'num_heads': vision['num_attention_heads'],
          'mlp_dim': vision['intermediate_size'],
          'embed_dim': vision['projection_dim'] if with_projection else None,
          'image_size': vision['image_size'], 'activation': ACTIVATIONS[act],
          'layer_norm_epsilon': vision.get('layer_norm_eps', 1e-5),
          'pixel_mean': list(PIXEL_MEAN), 'pixel_std': list(PIXEL_STD), 'dtype': 'float32'}


def hf_config(model: dict) -> dict:
  """A CLIPVisionModelWithProjection config.json for our `config.model`."""
  act = {ours: theirs for theirs, ours in ACTIVATIONS.items() if theirs != 'gelu_new'}
  return {'architectures': ['CLIPVisionModelWithProjection'], 'model_type': 'clip_vision_model',
          'hidden_size': model['width'], 'intermediate_size': model['mlp_dim'],
          'projection_dim': model['embed_dim'], 'num_hidden_layers': model['depth'],
          'num_attention_heads': model['num_heads'], 'num_channels': 3,
          'image_size': model['image_size'], 'patch_size': model['patch_size'],
          'hidden_act': act[model['activation']], 'layer_norm_eps': model['layer_norm_epsilon'],
          'torch_dtype': model.get('dtype', 'float32')}


def text_model_config(config: dict, *, with_projection: bool) -> dict:
  """Our text tower's `config.model` (editing/models/clip_text.py) from their config.json."""
  text = config.get('text_config', config)
  act = text.get('hidden_act', 'quick_gelu')
  if act not in ACTIVATIONS:
    raise ValueError(f'hidden_act {act!r} has no counterpart here; known: {sorted(ACTIVATIONS)}')
  projection = text.get('projection_dim', config.get('projection_dim'))
  return {'family': 'clip_text', 'vocab_size': text['vocab_size'],
          'context_length': text['max_position_embeddings'], 'width': text['hidden_size'],
          'depth': text['num_hidden_layers'], 'num_heads': text['num_attention_heads'],
          'mlp_dim': text['intermediate_size'],
          'embed_dim': projection if with_projection else None,
          'eos_token_id': text.get('eos_token_id', 2), 'activation': ACTIVATIONS[act],
          'layer_norm_epsilon': text.get('layer_norm_eps', 1e-5), 'dtype': 'float32'}


def text_hf_config(model: dict) -> dict:
  """A CLIPTextModelWithProjection config.json for our text tower's `config.model`."""
  act = {ours: theirs for theirs, ours in ACTIVATIONS.items() if theirs != 'gelu_new'}
  return {'architectures': ['CLIPTextModelWithProjection'], 'model_type': 'clip_text_model',
          'vocab_size': model['vocab_size'], 'max_position_embeddings': model['context_length'],
          'hidden_size': model['width'], 'num_hidden_layers': model['depth'],
          'num_attention_heads': model['num_heads'], 'intermediate_size': model['mlp_dim'],
          'projection_dim': model['embed_dim'], 'eos_token_id': model['eos_token_id'],
          'hidden_act': act[model['activation']], 'layer_norm_eps': model['layer_norm_epsilon'],
          'torch_dtype': model.get('dtype', 'float32')}
