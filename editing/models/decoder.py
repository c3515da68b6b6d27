"""One decoder-only language model for Llama, Mistral, Mixtral, Qwen2/3, Qwen2/3-MoE and
Gemma 2/3.

API:
  config = DecoderConfig.from_hf(config_json)   # config.json's dict (editing.models.
                                                # decoder_config); what it does not know, refused
  params = third_party.hf_decoder.to_params(tensors, config)  # {HF name: np array} -> float32
  config, params = third_party.hf_decoder.load(hf_directory)  # safetensors, single or sharded
  third_party.hf_decoder.export(params, config, directory)    # what transformers loads
  logits, cache = Decoder(config).apply({'params': params}, tokens, positions, mask[, cache])
  cache = init_cache(config, batch, slots)                    # for KV-cached decoding
Generation: editing.generate; log-likelihoods, perplexity, multiple choice: editing.scoring.

Each layer is pre-norm, with Gemma's extra post-norms where the family has them:
  h = x + post_attn_norm(attn(input_norm(x))),   y = h + post_mlp_norm(mlp(pre_mlp_norm(h))),
RMSNorm(x) = x / √(mean(x²) + ε) · w (Gemma: · (1 + w)), the MLP is down(act(gate(x)) ⊙ up(x))
(SwiGLU with silu, GeGLU with gelu), and attention is grouped-query softmax attention with RoPE
on queries and keys: each of the kv_heads key/value heads serves num_heads / kv_heads query
heads. The logits are final_norm(x) · Wᵀ, W the embedding when tied, soft-capped in Gemma 2.

Which keys a query sees is decided by positions, not slots: key j is visible to a query at
position p when j holds a real token (`mask`), its position is ≤ p and, on a sliding layer,
> p − window. So left- or right-padded batches give each real token what it gets alone.

Parameters are a plain nested dict: ``embed/embedding``, ``blocks_{i}/attn/{query,key,value,
out}/kernel`` (+ ``bias``), ``blocks_{i}/attn/{query,key}_norm/scale``, ``blocks_{i}/
{input_norm,post_attn_norm,pre_mlp_norm,post_mlp_norm}/scale``, ``blocks_{i}/mlp/{gate,up,
down}/kernel`` (Mixtral: ``blocks_{i}/mlp/router/kernel`` and ``blocks_{i}/mlp/experts_{e}/
{gate,up,down}/kernel``), ``final_norm/scale``, ``lm_head/kernel`` (untied only). The
attention leaves are named as the encoders' are, so every regime and merge applies unchanged;
their logical axes are in editing/sharding.py. The residual stream entering each layer is
sown as ``intermediates/layer_inputs`` (a tuple, layer 0 first) and the final normalised states
as ``intermediates/hidden``.
"""

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from editing.models.decoder_config import DecoderConfig
from editing.models.rope import Rope

Dtype = Any
ACTIVATIONS = {
    'silu': nn.silu, 'swish': nn.silu,
    'gelu': lambda x: nn.gelu(x, approximate=False),
    'gelu_pytorch_tanh': lambda x: nn.gelu(x, approximate=True),
    'gelu_new': lambda x: nn.gelu(x, approximate=True),
}


class KVCache(NamedTuple):
  """Keys and values of the tokens seen so far, in preallocated slots.

  keys, values: per layer, (batch, slots, kv_heads, head_dim), RoPE already applied to keys.
  positions:    (batch, slots) int32, each slot's token position; −1 for padding and for
                slots not yet written.
  length:       () int32, the slots written so far (the same in every row: padding fills
                slots too).
  """

  keys: tuple
  values: tuple
  positions: jax.Array
  length: jax.Array


def init_cache(config: DecoderConfig, batch: int, slots: int,
               dtype: Dtype = jnp.float32) -> KVCache:
  """An empty cache of `slots` slots per row."""
  shape = (batch, slots, config.num_kv_heads, config.head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
  return KVCache(zeros, zeros, jnp.full((batch, slots), -1, jnp.int32), jnp.zeros((), jnp.int32))


class RMSNorm(nn.Module):
  """x / √(mean(x²) + ε) · w over the last axis, in float32; Gemma's form scales by (1 + w)
  and so starts from w = 0."""

  eps: float
  plus_one: bool = False
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale = self.param('scale', init, (x.shape[-1],)).astype(jnp.float32)
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * (1 + scale if self.plus_one else scale)).astype(self.dtype)


def apply_rope(x, positions, rope: Rope):
  """x (batch, tokens, heads, head_dim) with each pair (x_i, x_{i+d/2}) rotated by the angle
  position · ω_i."""
  omega = jnp.asarray(rope.inverse_frequencies(x.shape[-1]))
  angles = positions.astype(jnp.float32)[..., None] * omega
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-second, first], axis=-1)
  return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def softcap(x, cap: float | None):
  """cap · tanh(x / cap), or x when cap is None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def visible(query_positions, key_positions, window: int | None):
  """(batch, 1, queries, keys) True where a query may attend a key: the key is a token
  (position ≥ 0), not after the query, and within `window` of it when there is one."""
  q, k = query_positions[:, None, :, None], key_positions[:, None, None, :]
  ok = (k >= 0) & (k <= q)
  return ok if window is None else ok & (q - k < window)


class _OfLayer(nn.Module):
  """A module of layer `layer`, whose switches (window, RoPE) may differ by layer."""

  config: DecoderConfig
  layer: int
  dtype: Dtype = jnp.float32


class Attention(_OfLayer):
  """Grouped-query attention with separate Wq, Wk, Wv, Wo leaves."""

  @nn.compact
  def __call__(self, x, positions, key_positions, cached=None):
    """`positions`: (batch, tokens) of x's tokens; `key_positions`: (batch, keys) of the keys
    attended (x's own, or the cache's after x is written); `cached`: (keys, values, slot) to
    write this chunk's keys and values into at `slot`. Returns (output, (keys, values))."""
    c = self.config
    dense = lambda heads, name, bias: nn.DenseGeneral(
        (heads, c.head_dim), use_bias=bias, dtype=self.dtype, name=name)
    q = dense(c.num_heads, 'query', c.qkv_bias)(x)
    k = dense(c.num_kv_heads, 'key', c.qkv_bias)(x)
    v = dense(c.num_kv_heads, 'value', c.qkv_bias)(x)
    if c.family.qk_norm:
      q = RMSNorm(c.rms_norm_eps, c.family.gemma, self.dtype, name='query_norm')(q)
      k = RMSNorm(c.rms_norm_eps, c.family.gemma, self.dtype, name='key_norm')(k)
    rope = c.rope_of(self.layer)
    q, k = apply_rope(q, positions, rope), apply_rope(k, positions, rope)
    if cached is not None:
      keys, values, slot = cached
      k = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), slot, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(values, v.astype(values.dtype), slot, axis=1)
    batch, tokens = q.shape[:2]
    groups = c.num_heads // c.num_kv_heads
    q = q.reshape(batch, tokens, c.num_kv_heads, groups, c.head_dim)
    scores = jnp.einsum('btkgd,bskd->bkgts', q, k, preferred_element_type=jnp.float32)
    scores = softcap(scores * c.attention_scale, c.attn_logit_softcapping)
    mask = visible(positions, key_positions, c.window(self.layer))[:, :, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    y = jnp.einsum('bkgts,bskd->btkgd', weights, v.astype(self.dtype))
    y = y.reshape(batch, tokens, c.num_heads, c.head_dim)
    out = nn.DenseGeneral(c.hidden_size, axis=(-2, -1), use_bias=c.out_bias, dtype=self.dtype,
                          name='out')(y)
    return out, (k, v)


class Mlp(nn.Module):
  """down(act(gate(x)) ⊙ up(x)), of intermediate width `width` (default the config's)."""

  config: DecoderConfig
  dtype: Dtype = jnp.float32
  width: int | None = None

  @nn.compact
  def __call__(self, x):
    c = self.config
    dense = lambda width, name: nn.Dense(width, use_bias=c.mlp_bias, dtype=self.dtype,
                                         name=name)
    width = self.width or c.intermediate_size
    gate = ACTIVATIONS[c.activation](dense(width, 'gate')(x))
    return dense(c.hidden_size, 'down')(gate * dense(width, 'up')(x))


class Experts(nn.Module):
  """A mixture of gated MLPs (Mixtral, Qwen3-MoE, Qwen2-MoE): p = softmax(x Wr), the top k
  experts by p weighted by p renormalised over them, Σ_{e ∈ top k} p_e / Σ_{top k} p · mlp_e(x)
  (the Qwen MoEs renormalise only with norm_topk_prob, else weigh by p_e itself); Qwen2-MoE
  adds a shared expert every token takes, + sigmoid(x · w_gate) · mlp_shared(x).

  Every expert runs on every token and the unchosen ones are weighted by 0: the same function
  as routing tokens to their experts, and one dense program whatever the routing."""

  config: DecoderConfig
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    c = self.config
    logits = nn.Dense(c.num_experts, use_bias=False, dtype=self.dtype, name='router')(x)
    top, chosen = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32)), c.experts_per_token)
    if c.normalize_top_k:
      top = top / top.sum(-1, keepdims=True)
    weights = jnp.sum(jax.nn.one_hot(chosen, c.num_experts) * top[..., None], axis=-2)
    routed = sum(weights[..., e, None].astype(self.dtype) *
                 Mlp(c, self.dtype, c.expert_size or None, name=f'experts_{e}')(x)
                 for e in range(c.num_experts))
    if not c.shared_expert_size:
      return routed
    gate = nn.Dense(1, use_bias=False, dtype=self.dtype, name='shared_expert_gate')(x)
    return routed + jax.nn.sigmoid(gate) * Mlp(c, self.dtype, c.shared_expert_size,
                                              name='shared_expert')(x)


class Block(_OfLayer):
  """One layer: attention and gated MLP (or mixture of them), each pre-normed (and
  post-normed in Gemma)."""

  @nn.compact
  def __call__(self, x, positions, key_positions, cached=None):
    c = self.config
    norm = lambda name: RMSNorm(c.rms_norm_eps, c.family.gemma, self.dtype, name=name)
    y, kv = Attention(c, self.layer, self.dtype, name='attn')(
        norm('input_norm')(x), positions, key_positions, cached)
    x = x + (norm('post_attn_norm')(y) if c.family.gemma else y)
    mlp = Experts if c.num_experts else Mlp
    y = mlp(c, self.dtype, name='mlp')(norm('pre_mlp_norm')(x))
    return x + (norm('post_mlp_norm')(y) if c.family.gemma else y), kv


class Decoder(nn.Module):
  """(tokens, positions, mask[, cache]) -> (logits float32 (batch, tokens, vocab), cache).

  tokens, positions: (batch, tokens) int; mask: (batch, tokens), True for real tokens. With a
  cache, the tokens are written into its slots [length, length + tokens) and attend to
  everything written before; the cache returned has them. Without one, the returned cache is
  None.
  """

  config: DecoderConfig
  dtype: Dtype = jnp.float32
  # Recompute each layer's activations in the backward pass instead of keeping them: the
  # memory of training is then one layer's attention scores, not every layer's.
  remat: bool = False

  @nn.compact
  def __call__(self, tokens, positions, mask, cache: KVCache | None = None):
    c = self.config
    # Hugging Face's initializer_range: a unit-variance embedding, tied to the output, would
    # start every logit at a spread of √hidden_size.
    embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype,
                     embedding_init=nn.initializers.normal(0.02), name='embed')
    x = embed(tokens)
    if c.family.gemma:
      x = x * jnp.asarray(c.hidden_size**0.5, self.dtype)
    positions = positions.astype(jnp.int32)
    own = jnp.where(mask.astype(bool), positions, -1)
    if cache is None:
      key_positions = own
    else:
      key_positions = jax.lax.dynamic_update_slice_in_dim(cache.positions, own, cache.length, 1)
    keys, values = [], []
    block = nn.remat(Block) if self.remat else Block
    for i in range(c.num_layers):
      cached = None if cache is None else (cache.keys[i], cache.values[i], cache.length)
      self.sow('intermediates', 'layer_inputs', x)
      x, (k, v) = block(c, i, self.dtype, name=f'blocks_{i}')(x, positions, key_positions,
                                                              cached)
      keys.append(k)
      values.append(v)
    x = RMSNorm(c.rms_norm_eps, c.family.gemma, self.dtype, name='final_norm')(x)
    self.sow('intermediates', 'hidden', x)
    if c.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = nn.Dense(c.vocab_size, use_bias=False, dtype=self.dtype, name='lm_head')(x)
    logits = softcap(logits.astype(jnp.float32), c.final_logit_softcapping)
    if cache is not None:
      cache = KVCache(tuple(keys), tuple(values), key_positions,
                      cache.length + tokens.shape[1])
    return logits, cache
