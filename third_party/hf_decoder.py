"""Hugging Face causal LMs (Llama, Mistral, Mixtral, Qwen2/3, Gemma 2/3) ↔ editmerge's decoder
(`editing/models/decoder.py`).

Source: transformers, models/{llama,mistral,mixtral,qwen2,qwen3,gemma2,gemma3}/modeling_*.py
(*ForCausalLM). Their names, under `model.layers.{i}.`: self_attn.{q,k,v,o}_proj (weight, and
bias where the family has one), self_attn.{q,k}_norm, input_layernorm, post_attention_layernorm
(the norm before the MLP, except in Gemma, where it follows attention and
pre_feedforward_layernorm precedes the MLP), post_feedforward_layernorm (Gemma),
mlp.{gate,up,down}_proj (Mixtral: block_sparse_moe.gate and block_sparse_moe.experts.{e}.
{w1 = gate, w3 = up, w2 = down}); model.embed_tokens, model.norm and, untied, lm_head.

  to_params(tensors, config)    {HF name: array} -> our params (every name checked at once)
  from_params(params, config)   our params -> {HF name: array}
  load(path, mesh=)             (config, params) of a HF directory, one tensor at a time;
                                with a mesh, each leaf is placed on it as soon as it is read
  export(params, config, dir)   config.json + safetensors that transformers loads
"""

import collections.abc
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from editing import sharding
from editing import tree as tree_lib
from editing.errors import UserError
from editing.models import decoder
from editing.models import hf
from editing.models import keymap
from editing.models.decoder_config import DecoderConfig

# Saved beside the weights by some checkpoints, and not parameters: RoPE's frequency tables.
_BUFFER_SUFFIX = '.rotary_emb.inv_freq'
EMBEDDING = 'model.embed_tokens.weight'
TIED_HEAD = 'lm_head.weight'  # the embedding's copy, where the head is tied
# Mixtral's expert tensors by our MLP leaf: w1 the gate, w3 the up and w2 the down projection.
EXPERT_WEIGHTS = (('gate', 'w1'), ('up', 'w3'), ('down', 'w2'))


def rules(config: DecoderConfig) -> list[keymap.Rule]:
  """(our path, their name, layout) for every leaf of the decoder `config` describes."""
  layer = 'model.layers.{i}.'
  attn = [('query', 'q_proj'), ('key', 'k_proj'), ('value', 'v_proj')]
  table = [('embed/embedding', EMBEDDING, 'copy'),
           ('final_norm/scale', 'model.norm.weight', 'copy'),
           ('blocks_{i}/input_norm/scale', layer + 'input_layernorm.weight', 'copy')]
  for ours, theirs in attn:
    table.append((f'blocks_{{i}}/attn/{ours}/kernel', f'{layer}self_attn.{theirs}.weight',
                  'heads_in'))
    if config.qkv_bias:
      table.append((f'blocks_{{i}}/attn/{ours}/bias', f'{layer}self_attn.{theirs}.bias',
                    'heads_bias'))
  table.append(('blocks_{i}/attn/out/kernel', layer + 'self_attn.o_proj.weight', 'heads_out'))
  if config.out_bias:
    table.append(('blocks_{i}/attn/out/bias', layer + 'self_attn.o_proj.bias', 'copy'))
  if config.family.qk_norm:
    table += [('blocks_{i}/attn/query_norm/scale', layer + 'self_attn.q_norm.weight', 'copy'),
              ('blocks_{i}/attn/key_norm/scale', layer + 'self_attn.k_norm.weight', 'copy')]
  if config.family.gemma:
    table += [('blocks_{i}/post_attn_norm/scale', layer + 'post_attention_layernorm.weight',
               'copy'),
              ('blocks_{i}/pre_mlp_norm/scale', layer + 'pre_feedforward_layernorm.weight',
               'copy'),
              ('blocks_{i}/post_mlp_norm/scale', layer + 'post_feedforward_layernorm.weight',
               'copy')]
  else:
    table.append(('blocks_{i}/pre_mlp_norm/scale', layer + 'post_attention_layernorm.weight',
                  'copy'))
  if config.num_experts:
    # The names transformers 5 saves and older ones wrote (its loader fuses the experts).
    table.append(('blocks_{i}/mlp/router/kernel', router_name(config, '{i}'), 'linear'))
    table += [(f'blocks_{{i}}/mlp/experts_{e}/{ours}/kernel', expert_name(config, '{i}', e, ours),
               'linear') for e in range(config.num_experts) for ours, _ in EXPERT_WEIGHTS]
    if config.shared_expert_size:
      table += [(f'blocks_{{i}}/mlp/shared_expert/{ours}/kernel',
                 f'{layer}mlp.shared_expert.{ours}_proj.weight', 'linear')
                for ours, _ in EXPERT_WEIGHTS]
      table.append(('blocks_{i}/mlp/shared_expert_gate/kernel',
                    layer + 'mlp.shared_expert_gate.weight', 'linear'))
  else:
    for name in ('gate', 'up', 'down'):
      table.append((f'blocks_{{i}}/mlp/{name}/kernel', f'{layer}mlp.{name}_proj.weight',
                    'linear'))
      if config.mlp_bias:
        table.append((f'blocks_{{i}}/mlp/{name}/bias', f'{layer}mlp.{name}_proj.bias', 'copy'))
  if not config.tie_embeddings:
    table.append(('lm_head/kernel', TIED_HEAD, 'linear'))
  return keymap.expand(table, config.num_layers)


def router_name(config: DecoderConfig, layer) -> str:
  """The HF name of layer `layer`'s router weight (Mixtral's or Qwen3-MoE's)."""
  moe = 'block_sparse_moe' if config.model_type == 'mixtral' else 'mlp'
  return f'model.layers.{layer}.{moe}.gate.weight'


def expert_name(config: DecoderConfig, layer, expert: int, leaf: str) -> str:
  """The HF name of expert `expert`'s `leaf` ('gate', 'up' or 'down') weight in layer
  `layer`: Mixtral's w1, w3, w2, or Qwen3-MoE's gate_proj, up_proj, down_proj."""
  if config.model_type == 'mixtral':
    return f'model.layers.{layer}.block_sparse_moe.experts.{expert}.' \
           f'{dict(EXPERT_WEIGHTS)[leaf]}.weight'
  return f'model.layers.{layer}.mlp.experts.{expert}.{leaf}_proj.weight'


def param_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
  """{path: shape} of the decoder's params, traced without allocating them."""
  one = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  shapes = jax.eval_shape(decoder.Decoder(config).init, jax.random.PRNGKey(0), one, one,
                          jax.ShapeDtypeStruct((1, 1), jnp.bool_))
  return {p: tuple(x.shape) for p, x in tree_lib.flatten(shapes['params']).items()}


def _is_kv(path: str) -> bool:
  return '/attn/key/' in path or '/attn/value/' in path


def to_params(tensors: Mapping[str, np.ndarray], config: DecoderConfig, *,
              dtype: Any = np.float32, place: Callable[[str, np.ndarray], Any] | None = None
              ) -> dict:
  """Our params (numpy, `dtype`) from HF-named tensors, read one name at a time, checked by
  `check_tensors` first.

  `place(path, leaf)`, when given, takes each leaf as soon as it is converted, before the next
  tensor is read, and its result is the leaf kept (a device array, say)."""
  shape = lambda name: tuple(getattr(tensors[name], 'shape', None) or np.shape(tensors[name]))
  check_tensors({name: shape(name) for name in tensors}, config)
  read = lambda name: np.asarray(tensors[name]).astype(dtype)
  place = place or (lambda path, leaf: leaf)
  flat = {rule[0]: place(rule[0], leaf(rule, read, config)) for rule in rules(config)}
  return tree_lib.unflatten({path: flat[path] for path in param_shapes(config)})


def check_tensors(shapes: Mapping[str, tuple[int, ...]], config: DecoderConfig) -> None:
  """One UserError naming every missing, unexpected and misshapen tensor of {HF name: shape};
  RoPE buffers, and lm_head.weight when the embeddings are tied, are not parameters and are
  passed over (`is_parameter`)."""
  ours = param_shapes(config)
  expected = {theirs: keymap.their_shape(layout, ours[path])
              for path, theirs, layout in rules(config)}
  given = {n for n in shapes if is_parameter(n, config)}
  problems = [f'missing {n}' for n in sorted(set(expected) - given)]
  problems += [f'unexpected {n}' for n in sorted(given - set(expected))]
  problems += [f'{n} has shape {tuple(shapes[n])}, the model {expected[n]}'
               for n in sorted(set(expected) & given) if tuple(shapes[n]) != expected[n]]
  if problems:
    raise UserError(f'the tensors do not fit a {config.model_type} decoder: ' +
                    '; '.join(problems))


def is_parameter(name: str, config: DecoderConfig) -> bool:
  """Whether an HF tensor is one of the model's parameters: not a RoPE buffer, nor the tied
  copy of the embedding."""
  return not (name.endswith(_BUFFER_SUFFIX) or (config.tie_embeddings and name == TIED_HEAD))


def leaf(rule: keymap.Rule, read: Callable[[str], np.ndarray], config: DecoderConfig
         ) -> np.ndarray:
  """Our leaf of one rule (our path, their name, layout), its tensor read by `read`."""
  heads = config.num_kv_heads if _is_kv(rule[0]) else config.num_heads
  (_, value), = keymap.to_ours([rule], read, heads).items()
  return value


def from_params(params: Any, config: DecoderConfig) -> dict[str, np.ndarray]:
  """HF-named tensors (numpy, in the params' dtype) from our params."""
  flat = {path: np.asarray(x) for path, x in tree_lib.flatten(params).items()}
  return keymap.to_theirs(rules(config), flat)


class _Lazy(collections.abc.Mapping):
  """A checkpoint's tensors as a mapping that reads each one when asked, and its shapes from
  the file headers."""

  def __init__(self, checkpoint: hf.Checkpoint):
    self._checkpoint = checkpoint

  def __getitem__(self, name):
    return _Tensor(self._checkpoint, name)

  def __iter__(self):
    return iter(self._checkpoint.files)

  def __len__(self):
    return len(self._checkpoint.files)


class _Tensor:
  """One stored tensor: its shape from the header, its entries read on np.asarray."""

  def __init__(self, checkpoint: hf.Checkpoint, name: str):
    self._checkpoint, self._name = checkpoint, name
    self.shape = checkpoint.header(name)[0]

  def __array__(self, dtype=None, copy=None):
    del copy
    x = self._checkpoint.tensor(self._name)
    return x if dtype is None else x.astype(dtype)


def load(path: str, *, dtype: Any = np.float32, mesh: Mesh | None = None,
         sharding_rules: Sequence[tuple[str, Sequence[str | None]]] | None = None
         ) -> tuple[DecoderConfig, dict]:
  """(config, params) of a Hugging Face causal-LM directory (config.json and safetensors,
  single or sharded), each tensor read from disk only when it is converted.

  Without a mesh the params are numpy arrays on the host. With one, each leaf is checked and
  placed on the mesh as soon as it is converted, split as `sharding_rules` (the 'fsdp+tp'
  preset's logical rules by default, which use whichever axes the mesh has) say: the host
  holds one tensor at a time, and each device only its own shards."""
  checkpoint = hf.Checkpoint(path)
  config = DecoderConfig.from_hf(checkpoint.config)
  if mesh is None:
    params = to_params(_Lazy(checkpoint), config, dtype=dtype)
    tree_lib.check_finite(params, path)
    return config, params
  rules = sharding.logical_rules('fsdp+tp') if sharding_rules is None else sharding_rules
  shapes = tree_lib.unflatten({p: jax.ShapeDtypeStruct(s, dtype)
                               for p, s in param_shapes(config).items()})
  shardings = tree_lib.flatten(sharding.param_shardings(mesh, shapes, rules))

  def place(leaf_path: str, leaf: np.ndarray) -> jax.Array:
    tree_lib.check_finite({leaf_path: leaf}, path)
    # Each device copies only its own slice; in a multi-process run every process reads the
    # file and fills its own devices.
    return jax.make_array_from_callback(leaf.shape, shardings[leaf_path],
                                        lambda index: leaf[index])

  return config, to_params(_Lazy(checkpoint), config, dtype=dtype, place=place)


def export(params: Any, config: DecoderConfig, directory: str, *,
           shard_bytes: int = 2 * 1024**3, extra_files: dict[str, dict] | None = None) -> None:
  """Writes params as a Hugging Face directory (config.json, safetensors shards of at most
  `shard_bytes`, and `extra_files`: {name: JSON content}, e.g. a tokenizer's `files()`) that
  transformers' AutoModelForCausalLM loads; atomically (`hf.save`)."""
  hf.save(directory, from_params(params, config), config.to_hf(), shard_bytes=shard_bytes,
          extra_configs=extra_files)
