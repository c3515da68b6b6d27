"""CLIP's text tower (Radford et al., 2021), with the ViT's blocks and leaf names.

Token and position embeddings; pre-LN blocks under a causal mask (and the padding mask);
ln_final; the state at the end-of-text token, projected without bias:

  embed(text) = proj(ln_final(x)[eot]),   eot = the first `eos_token_id` in the ids (or, for
  checkpoints whose eos_token_id is 2, the largest id: the legacy rule transformers keeps).

The attention weights are ``blocks_{i}/attn/{query,key,value,out}/kernel`` as in the ViT.
The final token states are sown as ``intermediates/hidden``. `third_party/hf_clip.py` maps
Hugging Face's CLIPTextModel(WithProjection) and CLIPModel weights.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from editing.models import vit


class TextTransformer(nn.Module):
  """(input_ids, attention_mask) -> (batch, embed_dim) text embeddings."""

  vocab_size: int
  context_length: int
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  embed_dim: int | None
  eos_token_id: int
  activation: str = 'quick_gelu'
  layer_norm_epsilon: float = 1e-5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, input_ids, attention_mask):
    length = input_ids.shape[1]
    x = (nn.Embed(self.vocab_size, self.width, dtype=self.dtype, name='token_embedding')(input_ids)
         + nn.Embed(self.context_length, self.width, dtype=self.dtype,
                    name='position_embedding')(jnp.arange(length)))
    causal = jnp.tril(jnp.ones((length, length), bool))
    mask = causal[None, None] & attention_mask.astype(bool)[:, None, None, :]
    for i in range(self.depth):
      x = vit.Block(self.num_heads, self.mlp_dim, self.activation, self.layer_norm_epsilon,
                    self.dtype, name=f'blocks_{i}')(x, mask)
    x = nn.LayerNorm(self.layer_norm_epsilon, dtype=self.dtype, name='ln_final')(x)
    self.sow('intermediates', 'hidden', x)
    if self.eos_token_id == 2:
      eot = jnp.argmax(input_ids, axis=-1)
    else:
      eot = jnp.argmax(input_ids == self.eos_token_id, axis=-1)
    pooled = x[jnp.arange(x.shape[0]), eot]
    if self.embed_dim is None:
      return pooled
    return nn.Dense(self.embed_dim, use_bias=False, dtype=self.dtype, name='proj')(pooled)


def build(config: ml_collections.ConfigDict) -> TextTransformer:
  """The text tower a `config.model` section describes."""
  return TextTransformer(
      vocab_size=config.vocab_size, context_length=config.context_length, width=config.width,
      depth=config.depth, num_heads=config.num_heads, mlp_dim=config.mlp_dim,
      embed_dim=config.embed_dim, eos_token_id=config.eos_token_id,
      activation=config.get('activation', 'quick_gelu'),
      layer_norm_epsilon=config.get('layer_norm_epsilon', 1e-5),
      dtype=jnp.dtype(config.get('dtype', 'float32')))
