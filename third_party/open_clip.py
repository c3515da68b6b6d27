"""open_clip's CLIP state dicts ↔ editmerge's ViT (`editing/models/vit.py`) and text transformer
(`editing/models/clip_text.py`).

Source: open_clip, src/open_clip/transformer.py (VisionTransformer, TextTransformer,
ResidualAttentionBlock over torch.nn.MultiheadAttention) and model.py (CLIP, CLIPVisionCfg,
CLIPTextCfg); the Hub's open_clip repositories keep the weights as open_clip_model.safetensors
beside open_clip_config.json ({"model_cfg": {...}, "preprocess_cfg": {"mean", "std"}}).
Differences from Hugging Face's layout: q, k and v are packed in one `attn.in_proj_weight`
(3·width rows, in that order) and `in_proj_bias`; the projections `visual.proj` and
`text_projection` are stored (width, embed) and applied as x @ proj; the activation is
QuickGELU only when the config says `quick_gelu` (OpenAI's weights), else exact GELU; a
block has width / head_width heads (head_width 64 by default).

Each rule is (our path, their name, layout), `{i}` standing for a block's index; the layouts
are `editing.models.keymap`'s.
"""

_BLOCK = 'transformer.resblocks.{i}.'
_BLOCK_RULES = (
    ('blocks_{i}/ln_1/scale', _BLOCK + 'ln_1.weight', 'copy'),
    ('blocks_{i}/ln_1/bias', _BLOCK + 'ln_1.bias', 'copy'),
    ('blocks_{i}/attn/query/kernel', _BLOCK + 'attn.in_proj_weight', 'heads_in@0/3'),
    ('blocks_{i}/attn/key/kernel', _BLOCK + 'attn.in_proj_weight', 'heads_in@1/3'),
    ('blocks_{i}/attn/value/kernel', _BLOCK + 'attn.in_proj_weight', 'heads_in@2/3'),
    ('blocks_{i}/attn/query/bias', _BLOCK + 'attn.in_proj_bias', 'heads_bias@0/3'),
    ('blocks_{i}/attn/key/bias', _BLOCK + 'attn.in_proj_bias', 'heads_bias@1/3'),
    ('blocks_{i}/attn/value/bias', _BLOCK + 'attn.in_proj_bias', 'heads_bias@2/3'),
    ('blocks_{i}/attn/out/kernel', _BLOCK + 'attn.out_proj.weight', 'heads_out'),
    ('blocks_{i}/attn/out/bias', _BLOCK + 'attn.out_proj.bias', 'copy'),
    ('blocks_{i}/ln_2/scale', _BLOCK + 'ln_2.weight', 'copy'),
    ('blocks_{i}/ln_2/bias', _BLOCK + 'ln_2.bias', 'copy'),
    ('blocks_{i}/mlp_fc/kernel', _BLOCK + 'mlp.c_fc.weight', 'linear'),
    ('blocks_{i}/mlp_fc/bias', _BLOCK + 'mlp.c_fc.bias', 'copy'),
    ('blocks_{i}/mlp_proj/kernel', _BLOCK + 'mlp.c_proj.weight', 'linear'),
    ('blocks_{i}/mlp_proj/bias', _BLOCK + 'mlp.c_proj.bias', 'copy'),
)
RULES = tuple((ours, 'visual.' + theirs, layout) for ours, theirs, layout in _BLOCK_RULES) + (
    ('class_embedding', 'visual.class_embedding', 'copy'),
    ('position_embedding', 'visual.positional_embedding', 'copy'),
    ('patch_embed/kernel', 'visual.conv1.weight', 'conv'),
    ('ln_pre/scale', 'visual.ln_pre.weight', 'copy'),
    ('ln_pre/bias', 'visual.ln_pre.bias', 'copy'),
    ('ln_post/scale', 'visual.ln_post.weight', 'copy'),
    ('ln_post/bias', 'visual.ln_post.bias', 'copy'),
    ('proj/kernel', 'visual.proj', 'copy'),
)
TEXT_RULES = _BLOCK_RULES + (
    ('token_embedding/embedding', 'token_embedding.weight', 'copy'),
    ('position_embedding/embedding', 'positional_embedding', 'copy'),
    ('ln_final/scale', 'ln_final.weight', 'copy'),
    ('ln_final/bias', 'ln_final.bias', 'copy'),
    ('proj/kernel', 'text_projection', 'copy'),
)
# The text tower's tensors are the top-level ones that are not the image tower's or the scale.
NOT_TEXT = ('visual.', 'logit_scale', 'logit_bias')
CONFIG = 'open_clip_config.json'
WEIGHTS = 'open_clip_model.safetensors'
# OpenAI CLIP's normalisation, open_clip's default when preprocess_cfg is absent.
PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)
PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)


def _activation(model_cfg: dict) -> str:
  return 'quick_gelu' if model_cfg.get('quick_gelu') else 'gelu'


def model_config(config: dict) -> dict:
  """Our vision `config.model` from an open_clip_config.json."""
  model_cfg = config['model_cfg']
  vision = model_cfg['vision_cfg']
  preprocess = config.get('preprocess_cfg', {})
  width = vision['width']
  return {'family': 'vit', 'patch_size': vision['patch_size'], 'width': width,
          'depth': vision['layers'], 'num_heads': width // vision.get('head_width', 64),
          'mlp_dim': int(width * vision.get('mlp_ratio', 4.0)),
          'embed_dim': model_cfg['embed_dim'], 'image_size': vision['image_size'],
          'activation': _activation(model_cfg), 'layer_norm_epsilon': 1e-5,
          'pixel_mean': list(preprocess.get('mean', PIXEL_MEAN)),
          'pixel_std': list(preprocess.get('std', PIXEL_STD)), 'dtype': 'float32'}


def text_model_config(config: dict) -> dict:
  """Our text tower's `config.model` from an open_clip_config.json. The end-of-text token is
  the vocabulary's last, where open_clip pools (the argmax of the ids)."""
  model_cfg = config['model_cfg']
  text = model_cfg['text_cfg']
  width = text['width']
  return {'family': 'clip_text', 'vocab_size': text['vocab_size'],
          'context_length': text['context_length'], 'width': width, 'depth': text['layers'],
          'num_heads': text['heads'], 'mlp_dim': int(width * text.get('mlp_ratio', 4.0)),
          'embed_dim': model_cfg['embed_dim'], 'eos_token_id': text['vocab_size'] - 1,
          'activation': _activation(model_cfg), 'layer_norm_epsilon': 1e-5, 'dtype': 'float32'}
