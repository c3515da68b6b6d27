"""A BERT encoder (Devlin et al., 2019) with the same addressable attention leaves as the ViT.

Token, position and token-type embeddings, summed and layer-normalised; post-LN blocks,
  x = ln_1(x + attn(x)),   x = ln_2(x + mlp(x)),
with exact (erf) GELU; the pooler tanh(W·h_[CLS] + b). The attention weights are
``blocks_{i}/attn/{query,key,value,out}/kernel``, as in `editing.models.vit`, so every
fine-tuning regime works on it unchanged. The sentence embedding is `pooling`'s:

  mean     the mean of the token states over the attention mask (sentence-transformers)
  cls      the [CLS] token's state
  pooler   the pooler's output

The final token states are sown as ``intermediates/hidden``. `third_party/hf_bert.py` maps
Hugging Face's BertModel weights.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from editing.errors import UserError
from editing.models import vit

POOLINGS = ('mean', 'cls', 'pooler')


class Block(nn.Module):
  num_heads: int
  mlp_dim: int
  activation: str
  layer_norm_epsilon: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, mask):
    norm = lambda name: nn.LayerNorm(self.layer_norm_epsilon, dtype=self.dtype, name=name)
    x = norm('ln_1')(x + vit.MultiHeadAttention(self.num_heads, self.dtype, name='attn')(x, mask))
    y = vit.ACTIVATIONS[self.activation](nn.Dense(self.mlp_dim, dtype=self.dtype,
                                                   name='mlp_fc')(x))
    y = nn.Dense(x.shape[-1], dtype=self.dtype, name='mlp_proj')(y)
    return norm('ln_2')(x + y)


class BertEncoder(nn.Module):
  """(input_ids, attention_mask[, token_type_ids]) -> (batch, width) sentence embeddings."""

  vocab_size: int
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  max_positions: int = 512
  type_vocab_size: int = 2
  activation: str = 'gelu'
  layer_norm_epsilon: float = 1e-12
  pooling: str = 'mean'
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, input_ids, attention_mask, token_type_ids=None):
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    embed = lambda count, name: nn.Embed(count, self.width, dtype=self.dtype, name=name)
    x = (embed(self.vocab_size, 'word_embeddings')(input_ids) +
         embed(self.max_positions, 'position_embeddings')(jnp.arange(input_ids.shape[1])) +
         embed(self.type_vocab_size, 'token_type_embeddings')(token_type_ids))
    x = nn.LayerNorm(self.layer_norm_epsilon, dtype=self.dtype, name='ln_embed')(x)
    keys = attention_mask.astype(bool)[:, None, None, :]
    for i in range(self.depth):
      x = Block(self.num_heads, self.mlp_dim, self.activation, self.layer_norm_epsilon,
                self.dtype, name=f'blocks_{i}')(x, keys)
    self.sow('intermediates', 'hidden', x)
    pooled = jnp.tanh(nn.Dense(self.width, dtype=self.dtype, name='pooler')(x[:, 0]))
    if self.pooling == 'pooler':
      return pooled
    if self.pooling == 'cls':
      return x[:, 0]
    weights = attention_mask.astype(x.dtype)[..., None]
    return (x * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1e-9)


def build(config: ml_collections.ConfigDict) -> BertEncoder:
  """The encoder a `config.model` section describes."""
  if config.get('pooling', 'mean') not in POOLINGS:
    raise UserError(f'config.model.pooling = {config.pooling!r}: must be one of {POOLINGS}')
  if config.get('activation', 'gelu') not in vit.ACTIVATIONS:
    raise UserError(f'config.model.activation = {config.activation!r}: must be one of '
                    f'{sorted(vit.ACTIVATIONS)}')
  return BertEncoder(
      vocab_size=config.vocab_size, width=config.width, depth=config.depth,
      num_heads=config.num_heads, mlp_dim=config.mlp_dim,
      max_positions=config.get('max_positions', 512),
      type_vocab_size=config.get('type_vocab_size', 2),
      activation=config.get('activation', 'gelu'),
      layer_norm_epsilon=config.get('layer_norm_epsilon', 1e-12),
      pooling=config.get('pooling', 'mean'), dtype=jnp.dtype(config.get('dtype', 'float32')))
