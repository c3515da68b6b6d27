"""MoE upscaling: dense Llama or Mistral checkpoints made into one Mixtral, Qwen3 ones into a
Qwen3-MoE, or, with a shared expert, Llama, Mistral or Qwen2 ones into a Qwen2-MoE, as
mergekit-moe makes them (its YAML read by `merging.mergekit.moe`).

The base donates every tensor but the MLPs: embeddings, attention, norms, the head. Expert e
of every layer is source model e's MLP (Mixtral: gate_proj → w1, up_proj → w3, down_proj → w2;
Qwen3-MoE keeps the names), with N(0, noise_scale²) added and the down projection scaled by
residual_scale where the expert asks. The Qwen MoEs renormalise their top-k probabilities
(norm_topk_prob) and their experts are the base's width, as mergekit-moe writes them; a
Qwen2-MoE's shared expert is its source's MLP, its gate (1, hidden) set from its prompts as a
router is, and its q, k and v biases are the base's, or zeros where the base has none. The router of
layer i, a (experts, hidden) matrix W_i, is set by the gate mode [mergekit moe/router.py]:

  hidden, hidden_last   v_e = mean over e's positive prompts of the residual stream entering
                        layer i (layer 0: the embeddings) at the prompt's last token, minus the
                        same over its negative prompts; W_i[e] = v_e / ‖v_e‖
  hidden_avg            the same with each prompt's states averaged over its tokens
  cheap_embed           v_e = Σ of the embedding rows of every token of e's positive prompts,
                        unit norm (minus the negatives' so made, unit norm again); every layer
                        the same
  random                W_i[e] ~ N(0, 1); uniform_random U(−1/√hidden, 1/√hidden)

Each prompt is BOS + its text. Where this differs from mergekit-moe, by choice:
- the hidden states are computed in float32 (mergekit loads the base in bfloat16);
- hidden_avg averages each prompt's own tokens (mergekit averages over the left-padded batch's
  positions, the padding included, then over prompts);
- the random gates and the noise are drawn from `seed` (mergekit's from torch's unseeded
  generator).

Every tensor of every input is used, or the job refuses before writing: the base must hold
exactly a dense decoder's tensors, and each expert the base's architecture and MLP shapes.
The output goes through the one lifecycle of every checkpoint writer (`output`), with the
base's tokenizer files and a config.json that transformers and `editing.models` read.
"""

import os
from typing import Any, Sequence

import numpy as np
from absl import logging

from editing import safetensors_io
from editing.errors import UserError
from editing.models import decoder
from editing.models import hf
from editing.models import tokenizer as tokenizer_lib
from editing.models.decoder_config import DecoderConfig
from merging.checkpoints import output as output_lib
from merging.checkpoints import pipeline
from merging.checkpoints import plan as plan_lib
from merging.mergekit import moe as moe_lib
from third_party import hf_decoder

# The dense model_types each output takes (mergekit-moe's choice of output by its inputs).
OUTPUTS = {'mixtral': ('llama', 'mistral'), 'qwen3_moe': ('qwen3',),
           'qwen2_moe': ('llama', 'mistral', 'qwen2')}


def run(recipe: moe_lib.MoeRecipe, output: str, *, overwrite: bool = False, seed: int = 0,
        shard_bytes: int = 2 * 1024**3) -> dict:
  """Writes the MoE `recipe` describes to the Hugging Face directory `output`; returns a
  summary."""
  base = hf.Checkpoint(recipe.base_model)
  dense = _dense_config(base, 'base_model')
  # A shared expert makes a Qwen2-MoE; without one, the first output the base's type makes.
  architecture = recipe.architecture or next(
      (a for a, inputs in OUTPUTS.items() if dense.model_type in inputs and a != 'qwen2_moe'),
      None)
  if architecture is None or dense.model_type not in OUTPUTS[architecture]:
    raise UserError(f'base_model = {base.path} is a {dense.model_type}; '
                    + '; '.join(f'a {a} is upscaled from {" or ".join(inputs)} models'
                                for a, inputs in OUTPUTS.items())
                    + ' (a qwen2_moe with one shared expert)')
  if (architecture == 'qwen2_moe') != bool(recipe.shared_experts):
    takes = 'exactly one' if architecture == 'qwen2_moe' else 'no'
    raise UserError(f'a {architecture} takes {takes} shared expert')
  experts = recipe.experts + recipe.shared_experts
  sources = [hf.Checkpoint(e.source_model) for e in experts]
  for k, source in enumerate(sources):
    key = (f'experts[{k}]' if k < len(recipe.experts) else
           f'shared_experts[{k - len(recipe.experts)}]')
    _check_expert(_dense_config(source, f'{key}.source_model'), dense, key, source.path)
  config_json = moe_config(base.config, architecture, len(recipe.experts),
                           recipe.experts_per_token)
  moe = DecoderConfig.from_hf(config_json)
  _check_tensors(base, dense, 'base_model')
  output_lib.checked_path(output, [base.path, *(s.path for s in sources)])
  gates = gate_weights(recipe, base, dense, seed)
  plan = _tensor_plan(base, sources, recipe, moe, gates, seed)
  dtype = plan_lib.OUTPUT_DTYPES.get(recipe.dtype)
  entries = [(name, shape, dtype or stored) for name, (shape, stored, _) in sorted(plan.items())]
  shards = safetensors_io.plan_shards(entries, shard_bytes)
  readers = list({os.path.realpath(c.path): c for c in [base, *sources]}.values())
  record = {'plan': {'method': 'mergekit-moe', 'recipe': recipe.text, 'seed': seed},
            'inputs': [output_lib.fingerprint(c) for c in readers],
            'shards': [{'file': s.file, 'names': s.names} for s in shards]}
  target = output_lib.Target(output, [c.path for c in readers], record, readers=readers,
                             card=_card(recipe), copied_from=recipe.base_model,
                             config=config_json)

  def fill(partial: output_lib.Partial) -> None:
    watched = {os.path.realpath(c.path): r for c, r in zip(readers, partial.readers)}
    written = {name: dtype for name, _, dtype in entries}

    def prepare(name):
      return plan[name][2](lambda c: watched[os.path.realpath(c.path)]), written[name]

    def block(state, start, stop):
      tensor, out_dtype = state
      return np.asarray(tensor[start:stop]).astype(out_dtype, copy=False)

    pipeline.write_shards(partial, shards, prepare, block, 2)

  output_lib.write(target, fill, overwrite=overwrite)
  logging.info('upscaled %d experts over %d layers into %s', len(sources), dense.num_layers,
               output)
  return {'output': os.path.abspath(output), 'experts': len(sources),
          'experts_per_token': recipe.experts_per_token, 'tensors': len(plan)}


def _card(recipe: moe_lib.MoeRecipe) -> str:
  """The output's model card: the upscaling and its recipe, in Markdown."""
  experts = '\n'.join(f'  - `{e.source_model}`' for e in recipe.experts)
  return (f'# Upscaled model\n\nA mixture of {len(recipe.experts)} experts, '
          f'{recipe.experts_per_token} per token, routers by gate mode `{recipe.gate_mode}` '
          f'(`python -m launch.merge_checkpoints --config.mergekit_moe`, editmerge).\n\n'
          f'- base: `{recipe.base_model}`\n- experts:\n{experts}\n\n'
          f'## Recipe (mergekit-moe YAML)\n\n```yaml\n{recipe.text.rstrip()}\n```\n')


def moe_config(base_json: dict, architecture: str, experts: int, per_token: int) -> dict:
  """The base's config.json as a Mixtral's (its fields, the experts', no sliding window) or a
  Qwen MoE's (its fields, the experts' of the base's width, renormalised top-k; Qwen2-MoE's
  shared expert of the base's width too, and q, k, v biases)."""
  config = {k: v for k, v in base_json.items()
            if k not in ('attention_bias', 'mlp_bias', 'pretraining_tp', 'is_llama_config')}
  if architecture == 'mixtral':
    return {**config, 'model_type': 'mixtral', 'architectures': ['MixtralForCausalLM'],
            'num_local_experts': experts, 'num_experts_per_tok': per_token,
            'sliding_window': None}
  qwen = {'num_experts': experts, 'num_experts_per_tok': per_token, 'decoder_sparse_step': 1,
          'norm_topk_prob': True, 'mlp_only_layers': [],
          'moe_intermediate_size': base_json['intermediate_size']}
  if architecture == 'qwen3_moe':
    return {**config, **qwen, 'model_type': 'qwen3_moe',
            'architectures': ['Qwen3MoeForCausalLM']}
  return {**config, **qwen, 'model_type': 'qwen2_moe', 'architectures': ['Qwen2MoeForCausalLM'],
          'qkv_bias': True, 'sliding_window': None, 'use_sliding_window': False,
          'shared_expert_intermediate_size': base_json['intermediate_size']}


def gate_weights(recipe: moe_lib.MoeRecipe, base: hf.Checkpoint, dense: DecoderConfig,
                 seed: int) -> np.ndarray:
  """(layers, experts, hidden) float32: every layer's router weight, by `recipe.gate_mode`,
  and after the experts' rows, the shared expert's gate where there is one."""
  experts = recipe.experts + recipe.shared_experts
  shape = (dense.num_layers, len(experts), dense.hidden_size)
  rng = np.random.default_rng([seed, 0])
  if recipe.gate_mode == 'random':
    return rng.standard_normal(shape).astype(np.float32)
  if recipe.gate_mode == 'uniform_random':
    bound = 1 / np.sqrt(dense.hidden_size)
    return rng.uniform(-bound, bound, shape).astype(np.float32)
  tokens = tokenizer_lib.Tokenizer.from_directory(recipe.base_model)
  bos = tokens.token_id('bos_token')
  encode = lambda prompts: [([] if bos is None else [bos]) +
                            tokens.encode(p, add_special_tokens=False) for p in prompts]
  if recipe.gate_mode == 'cheap_embed':
    embedding = base.tensor('model.embed_tokens.weight').astype(np.float32)
    summed = lambda prompts: _unit(sum(embedding[ids].sum(0) for ids in encode(prompts)))
    states = lambda prompts: np.broadcast_to(summed(prompts), shape[::2])
  else:
    _, params = hf_decoder.load(recipe.base_model)
    states = lambda prompts: layer_states(dense, params, encode(prompts),
                                          average=recipe.gate_mode == 'hidden_avg').mean(0)
  vectors = []
  for expert in experts:
    v = states(expert.positive_prompts)
    if expert.negative_prompts:
      v = v - states(expert.negative_prompts)
    vectors.append(_unit(v))
  return np.stack(vectors, axis=1).astype(np.float32)


def layer_states(config: DecoderConfig, params: Any, prompts: Sequence[Sequence[int]], *,
                 average: bool) -> np.ndarray:
  """(prompts, layers, hidden): the residual stream entering each layer, at each prompt's last
  token or averaged over its tokens; the prompts run as one right-padded batch."""
  length = max(len(p) for p in prompts)
  tokens = np.zeros((len(prompts), length), np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for row, ids in enumerate(prompts):
    tokens[row, :len(ids)], mask[row, :len(ids)] = ids, True
  positions = np.broadcast_to(np.arange(length), tokens.shape)
  _, sown = decoder.Decoder(config).apply({'params': params}, tokens, positions, mask,
                                          mutable=['intermediates'])
  inputs = np.stack([np.asarray(x, np.float32)
                     for x in sown['intermediates']['layer_inputs']], axis=1)
  if average:
    return (inputs * mask[:, None, :, None]).sum(2) / mask.sum(1)[:, None, None]
  last = mask.sum(1) - 1
  return inputs[np.arange(len(prompts)), :, last]


def _unit(v: np.ndarray) -> np.ndarray:
  """v / ‖v‖ over its last axis, the norm clamped at 1e-8 as mergekit clamps it."""
  return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-8)


def _dense_config(ckpt: hf.Checkpoint, key: str) -> DecoderConfig:
  """The config of a dense Llama, Mistral or Qwen3 checkpoint without biases, the ones the
  MoE outputs' layers take."""
  if not ckpt.config:
    raise UserError(f'{key} = {ckpt.path} has no config.json')
  config = DecoderConfig.from_hf(ckpt.config)
  dense = [t for inputs in OUTPUTS.values() for t in inputs]
  if config.model_type not in dense or config.attention_bias or config.mlp_bias:
    raise UserError(f'{key} = {ckpt.path} is a {config.model_type}'
                    f'{" with biases" if config.attention_bias or config.mlp_bias else ""}; '
                    f'experts are upscaled from {", ".join(dense)} models without biases')
  return config


def _check_expert(config: DecoderConfig, base: DecoderConfig, key: str, path: str) -> None:
  """An expert is the base's architecture, with the base's MLP and layer count."""
  fields = ('model_type', 'hidden_size', 'intermediate_size', 'num_layers', 'activation')
  differing = [f for f in fields if getattr(config, f) != getattr(base, f)]
  if differing:
    f = differing[0]
    raise UserError(f'{key}.source_model = {path} has {f} = {getattr(config, f)!r}, the '
                    f'base_model {getattr(base, f)!r}; experts must share the base\'s '
                    'architecture')


def _check_tensors(ckpt: hf.Checkpoint, config: DecoderConfig, key: str) -> None:
  """The checkpoint holds a dense decoder's tensors and nothing else: no tensor is dropped."""
  expected = {theirs for _, theirs, _ in hf_decoder.rules(config)}
  given = {n for n in ckpt.files if not n.endswith('.rotary_emb.inv_freq')
           and not (config.tie_embeddings and n == 'lm_head.weight')}
  unknown, missing = sorted(given - expected), sorted(expected - given)
  if unknown or missing:
    raise UserError(f'{key} = {ckpt.path}: ' + '; '.join(
        [f'unexpected {n} (no tensor of the MoE takes it)' for n in unknown[:3]] +
        [f'missing {n}' for n in missing[:3]]))


def _tensor_plan(base: hf.Checkpoint, sources: list, recipe: moe_lib.MoeRecipe,
                 moe: DecoderConfig, gates: np.ndarray, seed: int) -> dict:
  """{output name: (shape, stored dtype, make)}: make(reader_of) gives the tensor (flat) from
  the reader `reader_of(checkpoint)` returns, when it is written."""
  plan = {}
  layers, count = range(moe.num_layers), moe.num_experts
  shared = [f'model.layers.{i}.mlp.shared_expert{part}.weight' for i in layers
            for part in ('_gate', '.gate_proj', '.up_proj', '.down_proj')]
  mixture = {hf_decoder.router_name(moe, i) for i in layers} | set(shared) | {
      hf_decoder.expert_name(moe, i, e, leaf) for i in layers for e in range(count)
      for leaf, _ in hf_decoder.EXPERT_WEIGHTS}
  dtype = base.header(hf_decoder.EMBEDDING)[1]
  for _, theirs, _ in hf_decoder.rules(moe):
    if theirs in mixture:
      continue
    if theirs in base.files:
      shape, stored = base.header(theirs)
      plan[theirs] = (shape, stored, lambda of, n=theirs: of(base).tensor(n).reshape(-1))
    else:  # a Qwen2-MoE's q, k, v biases, which a Llama or Mistral base has not
      shape = (moe.head_dim * (moe.num_heads if '.q_proj.' in theirs else moe.num_kv_heads),)
      plan[theirs] = (shape, dtype, lambda of, s=shape: np.zeros(s, np.float32))
  everyone = list(zip(recipe.experts + recipe.shared_experts, sources))
  for i in layers:
    name = hf_decoder.router_name(moe, i)
    plan[name] = ((count, moe.hidden_size), dtype, lambda of, g=gates[i][:count]: g.reshape(-1))
    if recipe.shared_experts:
      name = f'model.layers.{i}.mlp.shared_expert_gate.weight'
      plan[name] = ((1, moe.hidden_size), dtype, lambda of, g=gates[i][count:]: g.reshape(-1))
    for e, (expert, source) in enumerate(everyone):
      for leaf, _ in hf_decoder.EXPERT_WEIGHTS:
        theirs = f'model.layers.{i}.mlp.{leaf}_proj.weight'
        out = (hf_decoder.expert_name(moe, i, e, leaf) if e < count else
               f'model.layers.{i}.mlp.shared_expert.{leaf}_proj.weight')
        shape, stored = source.header(theirs)
        plan[out] = (shape, stored, lambda of, s=source, n=theirs, x=expert, o=out, d=leaf:
                     _expert_tensor(of(s).tensor(n), x, o, d == 'down', seed))
  return plan


def _expert_tensor(tensor: np.ndarray, expert: moe_lib.Expert, name: str, down: bool,
                   seed: int) -> np.ndarray:
  """An expert's MLP tensor with its noise (drawn from the seed and the output tensor's name)
  and, for the down projection, its residual scale; flat."""
  x = tensor.astype(np.float32)
  if expert.noise_scale is not None:
    rng = np.random.default_rng([seed, *name.encode()])
    x = x + expert.noise_scale * rng.standard_normal(x.shape, dtype=np.float32)
  if down and expert.residual_scale is not None:
    x = x * np.float32(expert.residual_scale)
  return x.reshape(-1)
