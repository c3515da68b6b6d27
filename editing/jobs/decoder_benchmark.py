"""Measures a decoder language model's forward pass, training step and generation, in one
process, as ratios: against transformers' PyTorch eager on the same shapes (where torch is
installed and `config.benchmark.torch` is set), and against the device's peak (MFU).

The model is the shape of a Hugging Face config.json (`config.benchmark.model`, a dict of its
fields: `configs/decoder_benchmark.py` has SmolLM2-135M's and Llama-3.2-1B's), randomly
initialised; the weights do not change the time. Each of

  forward     logits of a (batch, length) block of tokens;
  train       one full fine-tuning step: the causal-LM loss (next-token cross-entropy over
              every position), its gradient and an AdamW update, params in float32, the
              compute in `config.benchmark.dtype`, each layer rematerialised in the backward
              pass with `config.benchmark.remat`;
  generate    greedy continuations of `config.benchmark.new_tokens` tokens from prompts of
              half the block (`editing.generate`, one compiled program over a KV cache);

is compiled first, then the JAX and PyTorch steps are timed interleaved, one of each in turn,
so that the machine's noise hits them alike; the median of `config.benchmark.steps` is kept.
FLOPs per step are the model's, as PaLM counts them (Chowdhery et al. 2022, appendix B): per
token 6N + 12·L·H·d·S for a training step and 2N + 4·L·H·d·S for a forward pass (N
parameters, L layers, H query heads of d dimensions, S tokens a row), so a recomputed layer
is not counted twice; MFU is their rate over the device's dense bf16 peak
(`benchmark.peak_flops`), none on a CPU. XLA's own count (`benchmark.step_flops`) is kept
beside it: on a GPU it misses the matrix products handed to cuBLAS.

Prints a table and writes <workdir>/decoder_benchmark.json.
"""

import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from editing import atomic
from editing import generate
from editing import tree as tree_lib
from editing.jobs import benchmark
from editing.models import decoder
from editing.models.decoder_config import DecoderConfig


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Times the forward pass, training step and generation; writes decoder_benchmark.json."""
  settings = config.benchmark
  model_config = DecoderConfig.from_hf(settings.model.to_dict())
  dtype = jnp.dtype(settings.dtype)
  model = decoder.Decoder(model_config, dtype=dtype, remat=settings.remat)
  rng = np.random.default_rng(settings.seed)
  tokens = rng.integers(0, model_config.vocab_size, (settings.batch_size, settings.length),
                        dtype=np.int32)
  positions = np.broadcast_to(np.arange(settings.length, dtype=np.int32), tokens.shape)
  mask = np.ones(tokens.shape, bool)
  params = jax.jit(model.init)(jax.random.PRNGKey(settings.seed), tokens[:1, :8],
                               positions[:1, :8], mask[:1, :8])['params']
  devices = jax.device_count()
  peak = settings.peak_flops or benchmark.peak_flops(jax.devices()[0].device_kind)

  forward = jax.jit(lambda p, t: model.apply({'params': p}, t, positions, mask)[0])
  forward_compiled = forward.lower(params, tokens).compile()
  optimizer = optax.adamw(1e-5)
  train_step = jax.jit(_train_step(model, optimizer, positions, mask), donate_argnums=(0, 1))
  state = [params, optimizer.init(params)]
  # The step donates its state: it is lowered on a copy's shapes, and keeps its own.
  train_compiled = train_step.lower(*state, tokens).compile()
  state = jax.tree.map(jnp.copy, state)

  def jax_forward():
    jax.block_until_ready(forward_compiled(params, tokens))

  def jax_train():
    state[0], state[1], loss = train_compiled(state[0], state[1], tokens)
    jax.block_until_ready(loss)

  steps = {'forward': jax_forward, 'train': jax_train}
  if settings.torch and jax.default_backend() == 'cpu':
    steps.update(_torch_steps(settings, tokens))
  seconds = _interleaved(steps, settings.steps)
  token_count = tokens.size
  count = tree_lib.num_params(params)
  flops = {name: token_count * model_flops_per_token(model_config, count, settings.length, name)
           for name in ('forward', 'train')}
  xla_flops = {'forward': benchmark.step_flops(forward_compiled, devices),
               'train': benchmark.step_flops(train_compiled, devices)}
  result = {
      'model': settings.model.to_dict(), 'params': count,
      'dtype': str(dtype), 'batch_size': settings.batch_size, 'length': settings.length,
      'devices': devices, 'device_kind': jax.devices()[0].device_kind,
      'steps': {name: {'median_s': s, 'tokens_per_s': token_count / s} for name, s in
                seconds.items()}}
  for name in flops:
    entry = result['steps'][name]
    entry['flops'], entry['xla_flops'] = flops[name], xla_flops[name]
    entry['mfu'] = benchmark.mfu(flops[name], seconds[name], peak, devices)
    if f'torch_{name}' in seconds:
      entry['speedup_over_torch'] = seconds[f'torch_{name}'] / seconds[name]
  result['generation'] = _generation(settings, model_config, params, tokens, dtype)
  os.makedirs(workdir, exist_ok=True)
  atomic.write_json(os.path.join(workdir, 'decoder_benchmark.json'), result)
  print(_table(result))
  return result


def model_flops_per_token(config: DecoderConfig, params: int, length: int, step: str) -> float:
  """PaLM's model FLOPs per token of a `step` ('forward' or 'train') over rows of `length`
  tokens: 2N + 4·L·H·d·S forward, three times that to train (the backward pass is twice the
  forward's)."""
  attention = 4 * config.num_layers * config.num_heads * config.head_dim * length
  forward = 2 * params + attention
  return 3 * forward if step == 'train' else forward


def _train_step(model, optimizer, positions, mask):
  """(params, opt_state, tokens) -> (params, opt_state, loss): one AdamW step on the mean
  next-token cross-entropy."""
  def loss_fn(params, tokens):
    logits = model.apply({'params': params}, tokens, positions, mask)[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def _interleaved(steps: dict, count: int) -> dict[str, float]:
  """The median seconds of each step, run one of each in turn after one warm-up round."""
  timings = {name: [] for name in steps}
  for round_ in range(count + 1):
    for name, step in steps.items():
      start = time.perf_counter()
      step()
      if round_:
        timings[name].append(time.perf_counter() - start)
    logging.info('decoder benchmark: round %d of %d', round_, count)
  return {name: float(np.median(t)) for name, t in timings.items()}


def _generation(settings, model_config, params, tokens, dtype) -> dict:
  """Greedy tokens per second of `editing.generate` (and of transformers' generate, where
  timed), from prompts of half the block."""
  prompts = [list(row[:settings.length // 2]) for row in tokens]
  generate.generate(model_config, params, prompts, max_new_tokens=settings.new_tokens,
                    dtype=dtype)  # compiles
  made = [generate.generate(model_config, params, prompts, max_new_tokens=settings.new_tokens,
                            dtype=dtype).tokens_per_second for _ in range(settings.steps)]
  result = {'new_tokens': settings.new_tokens, 'tokens_per_s': float(np.median(made))}
  if settings.torch and jax.default_backend() == 'cpu':
    result['torch_tokens_per_s'] = _torch_generation(settings, prompts)
    result['speedup_over_torch'] = result['tokens_per_s'] / result['torch_tokens_per_s']
  return result


def _torch_model(settings):
  """transformers' model of the same config.json, randomly initialised, eager attention."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  hf_config = transformers.AutoConfig.for_model(**settings.model.to_dict())
  hf_config._attn_implementation = 'eager'  # pylint: disable=protected-access
  torch.manual_seed(settings.seed)
  return transformers.AutoModelForCausalLM.from_config(hf_config)


def _torch_steps(settings, tokens) -> dict:
  """{'torch_forward', 'torch_train'}: the same steps in PyTorch eager, float32."""
  import torch  # pylint: disable=g-import-not-at-top
  model = _torch_model(settings)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
  ids = torch.from_numpy(np.asarray(tokens, np.int64))

  def torch_forward():
    with torch.no_grad():
      model(input_ids=ids).logits.sum().item()

  def torch_train():
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

  return {'torch_forward': torch_forward, 'torch_train': torch_train}


def _torch_generation(settings, prompts) -> float:
  """Greedy new tokens per second of transformers' generate on the same prompts."""
  import torch  # pylint: disable=g-import-not-at-top
  model = _torch_model(settings)
  ids = torch.tensor(prompts, dtype=torch.int64)
  kwargs = dict(max_new_tokens=settings.new_tokens, min_new_tokens=settings.new_tokens,
                do_sample=False, pad_token_id=0)
  with torch.no_grad():
    model.generate(ids, **kwargs)  # warm-up
    rates = []
    for _ in range(settings.steps):
      start = time.perf_counter()
      model.generate(ids, **kwargs)
      rates.append(settings.new_tokens * len(prompts) / (time.perf_counter() - start))
  return float(np.median(rates))


def _table(result: dict) -> str:
  lines = [f'{result["params"]:,} params ({result["dtype"]}), batch {result["batch_size"]} × '
           f'{result["length"]} tokens, {result["devices"]} {result["device_kind"]} device(s)',
           f'{"step":>8} {"ms":>9} {"tokens/s":>10} {"TFLOP/s":>8} {"MFU":>6} {"× torch":>8}']
  for name, r in result['steps'].items():
    if name.startswith('torch_'):
      continue
    mfu, speedup = r.get('mfu'), r.get('speedup_over_torch')
    lines.append(f'{name:>8} {1e3 * r["median_s"]:9.1f} {r["tokens_per_s"]:10.0f} '
                 f'{r["flops"] / r["median_s"] / 1e12:8.3f} '
                 f'{"–" if mfu is None else f"{100 * mfu:.1f}%":>6} '
                 f'{"–" if speedup is None else f"{speedup:.2f}":>8}')
  g = result['generation']
  torch_part = (f'; transformers generate {g["torch_tokens_per_s"]:.0f} tokens/s, '
                f'{g["speedup_over_torch"]:.2f}x' if 'torch_tokens_per_s' in g else '')
  lines.append(f'generate: {g["tokens_per_s"]:.0f} new tokens/s greedy ({g["new_tokens"]} '
               f'each){torch_part}')
  return '\n'.join(lines)
