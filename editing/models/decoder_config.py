"""The decoder's configuration, read from and written as a Hugging Face config.json.

`DecoderConfig.from_hf(config_json)` understands the config.json of Llama, Mistral, Qwen2,
Qwen3, Gemma 2 and Gemma 3 (text) causal LMs, as transformers 4 and 5 write them. Every
field is either used, or listed in `IGNORED` with the reason it does not change the model's
function, or refused by name: a field not understood could change the model. The families
differ by switches, not by classes (`FAMILIES`):

  Gemma (2, 3)   RMSNorm scales by (1 + w), the embedding is scaled by √hidden_size, each
                 sub-layer is normalised before and after (x + norm(f(norm(x)))), attention is
                 scaled by query_pre_attn_scalar^-½, layers alternate local (sliding-window) and
                 global attention; Gemma 2 soft-caps attention and final logits, c·tanh(z/c)
  Qwen3, Gemma 3 RMSNorm over head_dim of each query and key head before RoPE
  Qwen2          biases on the query, key and value projections
  Mixtral        Mistral's layers with a mixture of experts for the MLP: each token takes the
                 top num_experts_per_tok of num_local_experts gated MLPs by a linear router's
                 softmax, weighted by their renormalised probabilities
  Qwen3-MoE      Qwen3's layers with Mixtral's mixture (num_experts of width
                 moe_intermediate_size), the probabilities renormalised only with norm_topk_prob
  Qwen2-MoE      Qwen2's layers with Qwen3-MoE's mixture and a shared expert, an MLP of width
                 shared_expert_intermediate_size that every token takes, weighted by
                 sigmoid(x · w_gate)

RoPE (`editing.models.rope`) is the default one (θ^(-2i/d)), linear scaling (÷ factor), or
Llama 3's banded rescaling; Gemma 3's local layers use their own θ (`local_rope`). `to_hf()` writes a
config.json in transformers 5's form, which `from_hf` reads back to an equal config.
"""

import dataclasses
from typing import Any, Mapping

from editing.errors import UserError
from editing.models import rope as rope_lib

# Fields that do not change what the model computes, each with the reason.
_TOKENS = "the tokenizer's and generation's business; generation takes its stop ids as arguments"
_DTYPE = 'the storage dtype; tensors carry their own, and the caller chooses the compute dtype'
_NO_EFFECT = "transformers' bookkeeping, no part of the function the weights compute"
IGNORED = {
    'transformers_version': 'which transformers wrote the file',
    'torch_dtype': _DTYPE, 'dtype': _DTYPE,
    'bos_token_id': _TOKENS, 'eos_token_id': _TOKENS, 'pad_token_id': _TOKENS,
    'use_cache': "switches transformers' own KV cache", 'cache_implementation':
        "chooses transformers' own KV cache",
    'initializer_range': 'initialises new weights; loaded weights need none',
    'attention_dropout': 'dropout acts in training only, and the decoder trains without it',
    'pretraining_tp': 'splits the MLP matmuls into slices whose sum is the same product',
    '_name_or_path': _NO_EFFECT, 'output_attentions': _NO_EFFECT,
    'output_hidden_states': _NO_EFFECT, 'return_dict': _NO_EFFECT, 'id2label': _NO_EFFECT,
    'label2id': _NO_EFFECT, 'problem_type': _NO_EFFECT, 'chunk_size_feed_forward': _NO_EFFECT,
    'is_encoder_decoder': _NO_EFFECT, 'tokenizer_class': _NO_EFFECT,
    'is_llama_config': 'a marker that nanotron writes (SmolLM2), no part of the function',
    'router_aux_loss_coef': "weighs the router's load-balancing loss in training",
    'output_router_logits': _NO_EFFECT, 'router_jitter_noise': 'scales inputs in training only',
}
# MLP activations by their Hugging Face names: SwiGLU (silu) or GeGLU (the gelus).
ACTIVATIONS = ('silu', 'swish', 'gelu', 'gelu_pytorch_tanh', 'gelu_new')
LAYER_TYPES = ('full_attention', 'sliding_attention')
_REQUIRED = ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
             'num_attention_heads')
_COMMON = set(_REQUIRED) | {'model_type', 'architectures', 'num_key_value_heads', 'head_dim',
                            'max_position_embeddings', 'rms_norm_eps', 'tie_word_embeddings',
                            'rope_theta', 'rope_scaling', 'rope_parameters',
                            'rope_interleaved'}
_QWEN_WINDOWS = {'use_sliding_window', 'sliding_window', 'max_window_layers', 'layer_types'}
_QWEN_MOE = {'num_experts', 'num_local_experts', 'num_experts_per_tok', 'moe_intermediate_size',
             'norm_topk_prob', 'decoder_sparse_step', 'mlp_only_layers'}
_GEMMA = {'hidden_activation', 'hidden_act', 'attention_bias', 'query_pre_attn_scalar',
          'sliding_window', 'layer_types', 'attn_logit_softcapping', 'final_logit_softcapping',
          'use_bidirectional_attention'}


@dataclasses.dataclass(frozen=True)
class Family:
  """One model_type: its causal-LM class, the fields it reads beyond `_COMMON`, its switches
  and the values transformers assumes for fields a config.json leaves out."""

  architecture: str
  fields: frozenset
  defaults: Mapping[str, Any]
  gemma: bool = False  # (1 + w) norms, √d embedding scale, post-norms
  qk_norm: bool = False
  qkv_bias: bool | None = None  # fixed by the family; None: from attention_bias
  moe: bool = False  # the MLP is a mixture of experts


def _family(architecture, fields, gemma=False, qk_norm=False, qkv_bias=None, moe=False,
            **defaults):
  base = {'rope_theta': 10000.0, 'rms_norm_eps': 1e-6, 'hidden_act': 'silu',
          'tie_word_embeddings': gemma, 'attention_bias': False}
  return Family(architecture, frozenset(fields), {**base, **defaults}, gemma, qk_norm, qkv_bias,
                moe)


FAMILIES = {
    'llama': _family('LlamaForCausalLM', {'hidden_act', 'attention_bias', 'mlp_bias'},
                     max_position_embeddings=2048),
    'mistral': _family('MistralForCausalLM', {'hidden_act', 'sliding_window'}, qkv_bias=False,
                       max_position_embeddings=131072, sliding_window=4096),
    'mixtral': _family('MixtralForCausalLM', {'hidden_act', 'sliding_window', 'num_local_experts',
                                              'num_experts_per_tok'}, qkv_bias=False, moe=True,
                       max_position_embeddings=131072, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
                       sliding_window=None, num_local_experts=8, num_experts_per_tok=2),
    'qwen2': _family('Qwen2ForCausalLM', {'hidden_act'} | _QWEN_WINDOWS, qkv_bias=True,
                     max_position_embeddings=32768, max_window_layers=28),
    'qwen3': _family('Qwen3ForCausalLM', {'hidden_act', 'attention_bias'} | _QWEN_WINDOWS,
                     qk_norm=True, max_position_embeddings=32768, max_window_layers=28),
    'qwen3_moe': _family('Qwen3MoeForCausalLM', {'hidden_act', 'attention_bias'} | _QWEN_WINDOWS |
                         _QWEN_MOE, qk_norm=True, moe=True, max_position_embeddings=32768,
                         max_window_layers=28, num_local_experts=128, num_experts_per_tok=8,
                         moe_intermediate_size=768, norm_topk_prob=False,
                         decoder_sparse_step=1, mlp_only_layers=[]),
    'qwen2_moe': _family('Qwen2MoeForCausalLM', {'hidden_act', 'qkv_bias',
                                                 'shared_expert_intermediate_size'} |
                         _QWEN_WINDOWS | _QWEN_MOE, qkv_bias=True, moe=True,
                         max_position_embeddings=32768, max_window_layers=28,
                         num_local_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                         shared_expert_intermediate_size=5632, norm_topk_prob=False,
                         decoder_sparse_step=1, mlp_only_layers=[]),
    'gemma2': _family('Gemma2ForCausalLM', _GEMMA, gemma=True, max_position_embeddings=8192,
                      hidden_activation='gelu_pytorch_tanh', query_pre_attn_scalar=256,
                      sliding_window=4096, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0),
    'gemma3_text': _family('Gemma3ForCausalLM', _GEMMA | {
        'rope_local_base_freq', 'sliding_window_pattern', '_sliding_window_pattern'},
                           gemma=True, qk_norm=True, max_position_embeddings=131072,
                           hidden_activation='gelu_pytorch_tanh', query_pre_attn_scalar=256,
                           sliding_window=4096, rope_theta=1_000_000.0,
                           rope_local_base_freq=10000.0),
}


def _ropes(cfg: Mapping, family: Family,
           gemma3: bool) -> tuple[rope_lib.Rope, rope_lib.Rope]:
  """(RoPE of global layers, RoPE of local ones), from transformers 5's rope_parameters or
  the older rope_theta / rope_scaling (/ rope_local_base_freq), in the config.json as given."""
  theta = cfg.get('rope_theta') or family.defaults['rope_theta']
  local_theta = cfg.get('rope_local_base_freq') or family.defaults.get('rope_local_base_freq')
  if 'rope_parameters' in cfg:
    clash = [k for k in ('rope_theta', 'rope_scaling', 'rope_local_base_freq') if k in cfg]
    if clash:
      raise UserError(f'config.json gives both rope_parameters and {clash[0]}; keep one form')
    params = cfg['rope_parameters'] or {}
    if gemma3:
      return (rope_lib.from_entry(params.get('full_attention') or {},
                                  'rope_parameters.full_attention', theta),
              rope_lib.from_entry(params.get('sliding_attention') or {},
                                  'rope_parameters.sliding_attention', local_theta))
    rope = rope_lib.from_entry(params, 'rope_parameters', theta)
    return rope, rope
  rope = rope_lib.from_entry(cfg.get('rope_scaling') or {}, 'rope_scaling', theta)
  return rope, (rope_lib.Rope(theta=float(local_theta)) if gemma3 else rope)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """What the decoder computes, in the names of a Hugging Face config.json where it has one."""

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  max_position_embeddings: int
  rms_norm_eps: float
  activation: str  # a Hugging Face activation name, one of ACTIVATIONS
  tie_embeddings: bool
  attention_bias: bool  # biases on q, k, v and o (Llama, Qwen3, Gemma); Qwen2: q, k, v only
  mlp_bias: bool
  layer_types: tuple[str, ...]  # per layer, one of LAYER_TYPES
  sliding_window: int | None  # keys within this distance of the query, on sliding layers
  rope: rope_lib.Rope
  local_rope: rope_lib.Rope  # of the sliding layers; the same as `rope` except in Gemma 3
  query_pre_attn_scalar: float | None = None  # scores scale by its ^-½; None: head_dim
  attn_logit_softcapping: float | None = None
  final_logit_softcapping: float | None = None
  num_experts: int = 0  # 0: one dense MLP per layer
  experts_per_token: int = 0
  expert_size: int = 0  # each expert's intermediate width; 0: intermediate_size
  normalize_top_k: bool = True  # the chosen experts' probabilities renormalised to sum to 1
  shared_expert_size: int = 0  # the width of the shared expert every token takes; 0: none

  @property
  def family(self) -> Family:
    return FAMILIES[self.model_type]

  @property
  def qkv_bias(self) -> bool:
    fixed = self.family.qkv_bias
    return self.attention_bias if fixed is None else fixed

  @property
  def out_bias(self) -> bool:
    return self.attention_bias and self.family.qkv_bias is None

  @property
  def attention_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  def window(self, layer: int) -> int | None:
    """The sliding window of `layer`, None for global attention."""
    return self.sliding_window if self.layer_types[layer] == 'sliding_attention' else None

  def rope_of(self, layer: int) -> rope_lib.Rope:
    return self.local_rope if self.layer_types[layer] == 'sliding_attention' else self.rope

  @classmethod
  def from_hf(cls, config_json: Mapping[str, Any]) -> 'DecoderConfig':
    """The config of a Hugging Face causal-LM config.json (a dict); a field, model_type or
    architecture not understood is a UserError naming it."""
    model_type = config_json.get('model_type')
    if model_type not in FAMILIES:
      raise UserError(f'config.json: model_type {model_type!r} is not a supported decoder; '
                      f'supported: {sorted(FAMILIES)}')
    family = FAMILIES[model_type]
    for architecture in config_json.get('architectures') or [family.architecture]:
      if architecture != family.architecture:
        raise UserError(f'config.json: architecture {architecture!r} is not supported for '
                        f'model_type {model_type!r}; supported: {family.architecture}')
    unknown = sorted(set(config_json) - _COMMON - family.fields - set(IGNORED))
    if unknown:
      raise UserError(f'config.json: field {unknown[0]!r} is not understood for model_type '
                      f'{model_type!r}; it could change the model, so it is refused')
    missing = [k for k in _REQUIRED if config_json.get(k) is None]
    if missing:
      raise UserError(f'config.json lacks {missing[0]}')
    cfg = {**family.defaults, **{k: v for k, v in config_json.items() if v is not None
                                 or k in ('sliding_window', 'attn_logit_softcapping',
                                          'final_logit_softcapping')}}
    return _build(cfg, config_json, family)

  def to_hf(self) -> dict:
    """This config as a transformers 5 config.json (for `from_hf` and transformers alike)."""
    family = self.family
    out = {'architectures': [family.architecture], 'model_type': self.model_type,
           'vocab_size': self.vocab_size, 'hidden_size': self.hidden_size,
           'intermediate_size': self.intermediate_size, 'num_hidden_layers': self.num_layers,
           'num_attention_heads': self.num_heads, 'num_key_value_heads': self.num_kv_heads,
           'head_dim': self.head_dim, 'max_position_embeddings': self.max_position_embeddings,
           'rms_norm_eps': self.rms_norm_eps, 'tie_word_embeddings': self.tie_embeddings,
           'hidden_activation' if family.gemma else 'hidden_act': self.activation}
    if self.model_type == 'gemma3_text':
      out['rope_parameters'] = {'full_attention': self.rope.to_hf(),
                                'sliding_attention': self.local_rope.to_hf()}
    else:
      out['rope_parameters'] = self.rope.to_hf()
    fields = family.fields
    optional = {'attention_bias': self.attention_bias, 'mlp_bias': self.mlp_bias,
                'sliding_window': self.sliding_window, 'layer_types': list(self.layer_types),
                'use_sliding_window': self.sliding_window is not None,
                'max_window_layers': _first_sliding(self.layer_types),
                'query_pre_attn_scalar': self.query_pre_attn_scalar,
                'attn_logit_softcapping': self.attn_logit_softcapping,
                'final_logit_softcapping': self.final_logit_softcapping,
                'num_local_experts': self.num_experts, 'num_experts': self.num_experts,
                'shared_expert_intermediate_size': self.shared_expert_size, 'qkv_bias': True,
                'num_experts_per_tok': self.experts_per_token,
                'moe_intermediate_size': self.expert_size, 'norm_topk_prob': self.normalize_top_k,
                'decoder_sparse_step': 1, 'mlp_only_layers': []}
    out.update({k: v for k, v in optional.items() if k in fields})
    return out


def _experts(cfg: Mapping, given: Mapping, name: str) -> dict:
  """The mixture's fields of a Mixtral, Qwen3-MoE or Qwen2-MoE config.json; a mixture that
  leaves some layers dense (decoder_sparse_step, mlp_only_layers) is refused by name."""
  # The Qwen MoEs' count is num_experts in their released config.json files, and
  # num_local_experts in what transformers 5 writes of Qwen3-MoE.
  count_key = 'num_experts' if name != 'mixtral' and 'num_experts' in given else \
      'num_local_experts'
  if 'num_experts' in given and 'num_local_experts' in given and \
      given['num_experts'] != given['num_local_experts']:
    raise UserError(f'config.json: num_experts = {given["num_experts"]} and num_local_experts = '
                    f'{given["num_local_experts"]} differ')
  experts = dict(num_experts=_positive_int(cfg, count_key),
                 experts_per_token=_positive_int(cfg, 'num_experts_per_tok'))
  if experts['experts_per_token'] > experts['num_experts']:
    raise UserError(f'config.json: num_experts_per_tok = {experts["experts_per_token"]} exceeds '
                    f'{count_key} = {experts["num_experts"]}')
  if name in ('qwen3_moe', 'qwen2_moe'):
    if cfg['decoder_sparse_step'] != 1 or cfg['mlp_only_layers']:
      raise UserError(f'config.json: decoder_sparse_step = {cfg["decoder_sparse_step"]}, '
                      f'mlp_only_layers = {cfg["mlp_only_layers"]}: layers with a dense MLP '
                      'among the mixtures are not supported')
    experts.update(expert_size=_positive_int(cfg, 'moe_intermediate_size'),
                   normalize_top_k=bool(cfg['norm_topk_prob']))
  if name == 'qwen2_moe':
    if cfg.get('qkv_bias') is False:
      raise UserError('config.json: qkv_bias = false; a Qwen2-MoE is read with its q, k and v '
                      'biases')
    experts['shared_expert_size'] = _positive_int(cfg, 'shared_expert_intermediate_size')
  return experts


def _first_sliding(layer_types) -> int:
  return next((i for i, t in enumerate(layer_types) if t == 'sliding_attention'),
              len(layer_types))


def _positive_int(cfg: Mapping, key: str) -> int:
  value = cfg[key]
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise UserError(f'config.json: {key} = {value!r} must be a positive integer')
  return value


def _layer_types(cfg: Mapping, family_name: str, layers: int, window) -> tuple[str, ...]:
  """Each layer's attention, from layer_types or the family's older pattern fields."""
  if cfg.get('layer_types') is not None:
    types = tuple(cfg['layer_types'])
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad or len(types) != layers:
      raise UserError(f'config.json: layer_types {list(types)} must list {layers} of '
                      f'{list(LAYER_TYPES)}')
  elif window is None:
    types = ('full_attention',) * layers
  elif family_name in ('mistral', 'mixtral'):
    types = ('sliding_attention',) * layers
  elif family_name in ('qwen2', 'qwen3'):
    types = tuple('sliding_attention' if i >= cfg['max_window_layers'] else 'full_attention'
                  for i in range(layers))
  else:  # Gemma: every pattern-th layer is global, every other one in Gemma 2
    pattern = (cfg.get('sliding_window_pattern') or cfg.get('_sliding_window_pattern') or
               (2 if family_name == 'gemma2' else 6))
    types = tuple('sliding_attention' if (i + 1) % pattern else 'full_attention'
                  for i in range(layers))
  if 'sliding_attention' in types and window is None:
    raise UserError('config.json: layer_types has sliding_attention layers but sliding_window '
                    'is null')
  return types


def _build(cfg: dict, given: Mapping, family: Family) -> DecoderConfig:
  """A DecoderConfig from a config.json with the family's defaults filled in (`cfg`) and as
  given (`given`)."""
  name = cfg['model_type']
  sizes = {k: _positive_int(cfg, k) for k in _REQUIRED}
  heads = sizes['num_attention_heads']
  kv_heads = _positive_int(cfg, 'num_key_value_heads') if cfg.get('num_key_value_heads') \
      else heads
  if heads % kv_heads:
    raise UserError(f'config.json: num_attention_heads = {heads} is not a multiple of '
                    f'num_key_value_heads = {kv_heads}')
  head_dim = _positive_int(cfg, 'head_dim') if cfg.get('head_dim') else \
      sizes['hidden_size'] // heads
  activation = cfg['hidden_activation' if family.gemma else 'hidden_act']
  if activation not in ACTIVATIONS:
    raise UserError(f'config.json: activation {activation!r} is not supported; supported: '
                    f'{list(ACTIVATIONS)}')
  if family.gemma and given.get('hidden_act', activation) != activation:
    raise UserError(f'config.json: hidden_act = {given["hidden_act"]!r} differs from '
                    f'hidden_activation = {activation!r}, which Gemma\'s MLP uses')
  if cfg.get('rope_interleaved'):
    raise UserError('config.json: rope_interleaved = true rotates adjacent pairs; only the '
                    'Hugging Face layout (halves of each head) is read here')
  if cfg.get('use_bidirectional_attention'):
    raise UserError('config.json: use_bidirectional_attention = true is an encoder, not a '
                    'causal decoder')
  window = cfg.get('sliding_window')
  if name in ('qwen2', 'qwen3', 'qwen3_moe', 'qwen2_moe') and not cfg.get('use_sliding_window'):
    window = None
  if window is not None:
    window = _positive_int(cfg, 'sliding_window')
  rope, local_rope = _ropes(given, family, name == 'gemma3_text')
  experts = _experts(cfg, given, name) if family.moe else {}
  return DecoderConfig(
      model_type=name, vocab_size=sizes['vocab_size'], hidden_size=sizes['hidden_size'],
      intermediate_size=sizes['intermediate_size'], num_layers=sizes['num_hidden_layers'],
      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
      max_position_embeddings=int(cfg['max_position_embeddings']),
      rms_norm_eps=float(cfg['rms_norm_eps']), activation=activation,
      tie_embeddings=bool(cfg['tie_word_embeddings']),
      attention_bias=bool(cfg['attention_bias']), mlp_bias=bool(cfg.get('mlp_bias', False)),
      layer_types=_layer_types(cfg, name, sizes['num_hidden_layers'], window),
      sliding_window=window, rope=rope, local_rope=local_rope,
      query_pre_attn_scalar=cfg.get('query_pre_attn_scalar'),
      attn_logit_softcapping=cfg.get('attn_logit_softcapping'),
      final_logit_softcapping=cfg.get('final_logit_softcapping'), **experts)
