"""Hugging Face transformers' ViTModel ↔ editmerge's ViT (`editing/models/vit.py`).

Source: transformers, models/vit/modeling_vit.py (ViTEmbeddings, ViTPatchEmbeddings,
ViTSelfAttention, ViTLayer, ViTModel, ViTPooler, ViTForImageClassification) and
configuration_vit.py (ViTConfig); image_processing_vit.py for the default pixel statistics.
The names are those of the checkpoints on the Hub, which transformers also writes; a
ViTForImageClassification checkpoint holds the same tensors under `vit.` and a `classifier.`
that is not the encoder's. ViT differs from CLIP's tower in three places, each a `config.model`
option of ours: a bias on the patch projection (`patch_bias`), no LayerNorm before the blocks
(`pre_norm=False`), and an optional tanh pooler on the class token (`pooler`).

Each rule is (our path, their name, layout), `{i}` standing for a block's index; the layouts
are `editing.models.keymap`'s.
"""

# ViTImageProcessor's defaults (IMAGENET_STANDARD_MEAN / _STD), used when a checkpoint has no
# preprocessor_config.json.
PIXEL_MEAN = (0.5, 0.5, 0.5)
PIXEL_STD = (0.5, 0.5, 0.5)
# Their activation names -> ours (editing/models/vit.py: ACTIVATIONS).
ACTIVATIONS = {'gelu': 'gelu', 'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh',
               'quick_gelu': 'quick_gelu'}
NOT_OWNED_PREFIXES = ('classifier.',)

_LAYER = 'encoder.layer.{i}.'
RULES = (
    ('class_embedding', 'embeddings.cls_token', 'lead2'),
    ('position_embedding', 'embeddings.position_embeddings', 'lead1'),
    ('patch_embed/kernel', 'embeddings.patch_embeddings.projection.weight', 'conv'),
    ('patch_embed/bias', 'embeddings.patch_embeddings.projection.bias', 'copy'),
    ('blocks_{i}/ln_1/scale', _LAYER + 'layernorm_before.weight', 'copy'),
    ('blocks_{i}/ln_1/bias', _LAYER + 'layernorm_before.bias', 'copy'),
    ('blocks_{i}/attn/query/kernel', _LAYER + 'attention.attention.query.weight', 'heads_in'),
    ('blocks_{i}/attn/query/bias', _LAYER + 'attention.attention.query.bias', 'heads_bias'),
    ('blocks_{i}/attn/key/kernel', _LAYER + 'attention.attention.key.weight', 'heads_in'),
    ('blocks_{i}/attn/key/bias', _LAYER + 'attention.attention.key.bias', 'heads_bias'),
    ('blocks_{i}/attn/value/kernel', _LAYER + 'attention.attention.value.weight', 'heads_in'),
    ('blocks_{i}/attn/value/bias', _LAYER + 'attention.attention.value.bias', 'heads_bias'),
    ('blocks_{i}/attn/out/kernel', _LAYER + 'attention.output.dense.weight', 'heads_out'),
    ('blocks_{i}/attn/out/bias', _LAYER + 'attention.output.dense.bias', 'copy'),
    ('blocks_{i}/ln_2/scale', _LAYER + 'layernorm_after.weight', 'copy'),
    ('blocks_{i}/ln_2/bias', _LAYER + 'layernorm_after.bias', 'copy'),
    ('blocks_{i}/mlp_fc/kernel', _LAYER + 'intermediate.dense.weight', 'linear'),
    ('blocks_{i}/mlp_fc/bias', _LAYER + 'intermediate.dense.bias', 'copy'),
    ('blocks_{i}/mlp_proj/kernel', _LAYER + 'output.dense.weight', 'linear'),
    ('blocks_{i}/mlp_proj/bias', _LAYER + 'output.dense.bias', 'copy'),
    ('ln_post/scale', 'layernorm.weight', 'copy'),
    ('ln_post/bias', 'layernorm.bias', 'copy'),
    ('pooler/kernel', 'pooler.dense.weight', 'linear'),
    ('pooler/bias', 'pooler.dense.bias', 'copy'),
)


def model_config(config: dict, *, with_pooler: bool, preprocessor: dict | None) -> dict:
  """Our `config.model` (editing/models/vit.py) from their config.json and, where the
  checkpoint has one, preprocessor_config.json."""
  act = config.get('hidden_act', 'gelu')
  if act not in ACTIVATIONS:
    raise ValueError(f'hidden_act {act!r} has no counterpart here; known: {sorted(ACTIVATIONS)}')
  if not config.get('qkv_bias', True):
    raise ValueError('qkv_bias = false has no counterpart here: the attention projections '
                     'have biases')
  preprocessor = preprocessor or {}
  return {'family': 'vit', 'patch_size': config['patch_size'], 'width': config['hidden_size'],
          'depth': config['num_hidden_layers'], 'num_heads': config['num_attention_heads'],
          'mlp_dim': config['intermediate_size'], 'embed_dim': None,
          'image_size': config['image_size'], 'activation': ACTIVATIONS[act],
          'layer_norm_epsilon': config.get('layer_norm_eps', 1e-12),
          'pixel_mean': list(preprocessor.get('image_mean', PIXEL_MEAN)),
          'pixel_std': list(preprocessor.get('image_std', PIXEL_STD)),
          'patch_bias': True, 'pre_norm': False, 'pooler': with_pooler, 'dtype': 'float32'}


def hf_config(model: dict) -> dict:
  """A ViTModel config.json for our `config.model`."""
  act = {ours: theirs for theirs, ours in ACTIVATIONS.items() if theirs != 'gelu_new'}
  return {'architectures': ['ViTModel'], 'model_type': 'vit', 'hidden_size': model['width'],
          'num_hidden_layers': model['depth'], 'num_attention_heads': model['num_heads'],
          'intermediate_size': model['mlp_dim'], 'hidden_act': act[model['activation']],
          'layer_norm_eps': model['layer_norm_epsilon'], 'image_size': model['image_size'],
          'patch_size': model['patch_size'], 'num_channels': 3, 'qkv_bias': True,
          'torch_dtype': model.get('dtype', 'float32')}


def preprocessor_config(model: dict) -> dict:
  """A ViTImageProcessor preprocessor_config.json with our pixel statistics."""
  return {'image_processor_type': 'ViTImageProcessor', 'do_normalize': True,
          'do_rescale': True, 'do_resize': True, 'image_mean': list(model['pixel_mean']),
          'image_std': list(model['pixel_std']),
          'size': {'height': model['image_size'], 'width': model['image_size']}}
