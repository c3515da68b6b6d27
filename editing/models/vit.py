"""A Vision Transformer in the CLIP image-encoder layout.

Pre-LN blocks, a class token, learned position embeddings, and separate query/key/value/output
projections so that every attention weight is its own addressable leaf
(``blocks_{i}/attn/{query,key,value,out}/kernel``). The encoder maps images to a normalised-free
embedding ``proj(ln_post(x[:, 0]))`` (no `proj` when embed_dim is None); classification heads
live outside the module. The final token states are sown as ``intermediates/hidden``.

With `activation='quick_gelu'`, `layer_norm_epsilon=1e-5`, CLIP's pixel mean and std and its
sizes, it is OpenAI CLIP's vision tower exactly (`third_party/hf_clip.py` maps the weights).
With `patch_bias`, no `pre_norm`, exact GELU and optionally the `pooler` (tanh(dense(·)) of the
class token), it is Hugging Face's ViTModel (`third_party/hf_vit.py`): ViT, DeiT, DINO.
The suite's model keeps the defaults: tanh-approximated GELU and flax's LayerNorm epsilon.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from editing.errors import UserError

Dtype = Any
ACTIVATIONS = {
    'gelu_tanh': lambda x: nn.gelu(x, approximate=True),
    'gelu': lambda x: nn.gelu(x, approximate=False),  # exact (erf), as HF ViT and BERT
    'quick_gelu': lambda x: x * nn.sigmoid(1.702 * x),  # OpenAI CLIP
}


def _sincos_2d_init(h: int, w: int):
  """Initialises learned position embeddings (class token first, then the h x w patches) with
  2-D sine-cosine features, as big_vision's 'sincos2d'. With small random init the position
  signal is drowned by patch content and position-dependent tasks barely train from it."""

  def init(key, shape, dtype=jnp.float32):
    del key
    width = shape[-1]
    if width % 4:
      raise UserError(f'sincos position embeddings need width % 4 == 0, got {width}')
    y, x = jnp.mgrid[:h, :w]
    omega = 1.0 / 10000 ** (jnp.arange(width // 4) / (width // 4 - 1 or 1))
    y = y.reshape(-1, 1) * omega
    x = x.reshape(-1, 1) * omega
    patches = jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)
    return jnp.concatenate([jnp.zeros((1, width)), patches]).astype(dtype)

  return init


class MultiHeadAttention(nn.Module):
  """Softmax attention with four separate projections (Wq, Wk, Wv, Wo); `mask`, broadcast to
  (batch, heads, queries, keys), is True where a query may attend."""

  num_heads: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, mask=None):
    width = x.shape[-1]
    if width % self.num_heads:
      raise UserError(f'width {width} is not divisible by num_heads {self.num_heads}')
    head_dim = width // self.num_heads
    dense = lambda name: nn.DenseGeneral(
        (self.num_heads, head_dim), dtype=self.dtype, name=name)
    q, k, v = dense('query')(x), dense('key')(x), dense('value')(x)
    y = nn.dot_product_attention(q, k, v, mask=mask, dtype=self.dtype)
    return nn.DenseGeneral(width, axis=(-2, -1), dtype=self.dtype, name='out')(y)


class Block(nn.Module):
  """x + attn(ln_1(x)), then x + mlp(ln_2(x)), as in CLIP's ResidualAttentionBlock."""

  num_heads: int
  mlp_dim: int
  activation: str = 'gelu_tanh'
  layer_norm_epsilon: float = 1e-6
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, mask=None):
    norm = lambda name: nn.LayerNorm(self.layer_norm_epsilon, dtype=self.dtype, name=name)
    x = x + MultiHeadAttention(self.num_heads, self.dtype, name='attn')(norm('ln_1')(x), mask)
    y = norm('ln_2')(x)
    y = nn.Dense(self.mlp_dim, dtype=self.dtype, name='mlp_fc')(y)
    y = ACTIVATIONS[self.activation](y)
    y = nn.Dense(x.shape[-1], dtype=self.dtype, name='mlp_proj')(y)
    return x + y


class VisionTransformer(nn.Module):
  """Image encoder: (batch, H, W, C) images -> (batch, embed_dim) embeddings."""

  patch_size: int
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  embed_dim: int | None
  pixel_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
  pixel_std: tuple[float, ...] = (0.25, 0.25, 0.25)
  activation: str = 'gelu_tanh'
  layer_norm_epsilon: float = 1e-6
  patch_bias: bool = False
  pre_norm: bool = True
  pooler: bool = False
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, images):
    """Embeds images with pixel values in [0, 1]; they are standardised here, as CLIP's
    preprocessing does, because uncentred pixels make every patch token look alike."""
    images = (images - jnp.asarray(self.pixel_mean)) / jnp.asarray(self.pixel_std)
    x = nn.Conv(self.width, (self.patch_size,) * 2, strides=(self.patch_size,) * 2,
                padding='VALID', use_bias=self.patch_bias, dtype=self.dtype,
                name='patch_embed')(images)
    batch, h, w, _ = x.shape
    x = x.reshape(batch, h * w, self.width)
    cls = self.param('class_embedding', nn.initializers.normal(self.width**-0.5), (self.width,))
    x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (batch, 1, self.width)), x], axis=1)
    pos = self.param('position_embedding', _sincos_2d_init(h, w), (h * w + 1, self.width))
    norm = lambda name: nn.LayerNorm(self.layer_norm_epsilon, dtype=self.dtype, name=name)
    x = x + pos.astype(x.dtype)
    if self.pre_norm:
      x = norm('ln_pre')(x)
    for i in range(self.depth):
      x = Block(self.num_heads, self.mlp_dim, self.activation, self.layer_norm_epsilon,
                self.dtype, name=f'blocks_{i}')(x)
    self.sow('intermediates', 'hidden', x)
    # LayerNorm is per token: normalising the class token alone equals taking it from the
    # normalised sequence, as ViTModel does.
    x = norm('ln_post')(x[:, 0])
    if self.pooler:
      x = jnp.tanh(nn.Dense(self.width, dtype=self.dtype, name='pooler')(x))
    if self.embed_dim is None:
      return x
    return nn.Dense(self.embed_dim, use_bias=False, dtype=self.dtype, name='proj')(x)


def build(config: ml_collections.ConfigDict) -> VisionTransformer:
  """The encoder a `config.model` section describes; keys it omits take the suite's defaults
  (activation, layer_norm_epsilon, pixel_mean, pixel_std, patch_bias, pre_norm, pooler,
  dtype)."""
  activation = config.get('activation', 'gelu_tanh')
  if activation not in ACTIVATIONS:
    raise UserError(f'config.model.activation = {activation!r}: must be one of '
                    f'{sorted(ACTIVATIONS)}')
  defaults = VisionTransformer
  return VisionTransformer(
      patch_size=config.patch_size, width=config.width, depth=config.depth,
      num_heads=config.num_heads, mlp_dim=config.mlp_dim, embed_dim=config.embed_dim,
      pixel_mean=tuple(config.get('pixel_mean', defaults.pixel_mean)),
      pixel_std=tuple(config.get('pixel_std', defaults.pixel_std)), activation=activation,
      layer_norm_epsilon=config.get('layer_norm_epsilon', defaults.layer_norm_epsilon),
      patch_bias=config.get('patch_bias', defaults.patch_bias),
      pre_norm=config.get('pre_norm', defaults.pre_norm),
      pooler=config.get('pooler', defaults.pooler),
      dtype=jnp.dtype(config.get('dtype', 'float32')))
