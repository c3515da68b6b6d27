"""Checkpoint merging against the I/O floor, in one run, on a generated Llama-shaped fixture.

The fixture (hidden 1024, 8 layers, vocabulary 32,000, MLP 2,048, grouped key/value heads of
256: about 136M parameters, float32, about 545 MB a model) is a base and three fine-tunes,
written once to <workdir>/checkpoint_fixture. Each measurement runs in its own process, so its
peak RSS is its own:

  floor            read every input tensor once, add them, write the output: the merge's
                   own blocked reads, threads and writes around a numpy sum
  task_arithmetic  θ0 + Σ τ_t through merging.checkpoints
  ties             TIES at density 0.2, per tensor, through the same
  tsv_m, iso_cts   the SVD-era merges, each 2-D tensor held whole for its SVDs

They run in turn, each `REPEATS[what]` times over (the machine's noise moves all of them; the
floor's first read may also find a cold page cache), and each reports its fastest run. The table
reports wall time, its ratio to the floor, peak RSS and its ratio to the largest tensor's size.
"""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np

from editing import atomic
from editing.models import hf
from merging import checkpoints
from merging.checkpoints import pipeline

# The SVD merges run for minutes, where a second of noise is lost in the ratio.
REPEATS = {'floor': 5, 'task_arithmetic': 5, 'ties': 5, 'tsv_m': 1, 'iso_cts': 1}
SETTINGS = {'ties': {'density': 0.2, 'scope': 'tensor'}}
SHAPE = dict(hidden=1024, layers=8, vocab=32000, mlp=2048, kv=256)


def fixture_tensors(seed: int, base: dict | None = None,
                    shape: dict = SHAPE) -> dict[str, np.ndarray]:
  h, rng = shape['hidden'], np.random.default_rng(seed)
  shapes = {'model.embed_tokens.weight': (shape['vocab'], h), 'model.norm.weight': (h,),
            'lm_head.weight': (shape['vocab'], h)}
  for i in range(shape['layers']):
    layer = f'model.layers.{i}.'
    shapes.update({layer + 'self_attn.q_proj.weight': (h, h),
                   layer + 'self_attn.k_proj.weight': (shape['kv'], h),
                   layer + 'self_attn.v_proj.weight': (shape['kv'], h),
                   layer + 'self_attn.o_proj.weight': (h, h),
                   layer + 'mlp.gate_proj.weight': (shape['mlp'], h),
                   layer + 'mlp.up_proj.weight': (shape['mlp'], h),
                   layer + 'mlp.down_proj.weight': (h, shape['mlp']),
                   layer + 'input_layernorm.weight': (h,),
                   layer + 'post_attention_layernorm.weight': (h,)})
  out = {}
  for name, shape in shapes.items():
    noise = rng.standard_normal(shape, np.float32)
    out[name] = noise * 0.02 if base is None else base[name] + 0.001 * noise
  return out


def make_fixture(directory: str, shape: dict = SHAPE) -> tuple[str, list[str]]:
  base_dir = os.path.join(directory, 'base')
  models = [os.path.join(directory, f'ft{k}') for k in range(3)]
  if not all(os.path.exists(os.path.join(d, hf.SINGLE)) for d in [base_dir] + models):
    # The Llama config mergekit reads the layer count and sizes from (heads of 16 dimensions).
    config = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
              'hidden_size': shape['hidden'], 'num_hidden_layers': shape['layers'],
              'intermediate_size': shape['mlp'], 'vocab_size': shape['vocab'],
              'num_attention_heads': shape['hidden'] // 16,
              'num_key_value_heads': shape['kv'] // 16, 'tie_word_embeddings': False,
              'torch_dtype': 'float32'}
    base = fixture_tensors(0, shape=shape)
    hf.save(base_dir, base, config, shard_bytes=2**40)
    for k, path in enumerate(models):
      hf.save(path, fixture_tensors(k + 1, base, shape), config, shard_bytes=2**40)
  return base_dir, models


def measure(what: str, base: str, models: list[str], output: str) -> dict:
  """One measurement in this process: seconds and peak RSS. The clock starts once JAX's
  backend is up, a cost of the process (like its imports), not of the merge."""
  jax.devices()
  start = time.time()
  if what == 'floor':
    inputs = [hf.Checkpoint(p) for p in [base] + models]
    entries = [(n, *inputs[0].header(n)) for n in sorted(inputs[0].files)]

    def add(name: str, start: int, stop: int) -> np.ndarray:
      blocks = pipeline.read_block(inputs, name, start, stop, stop - start,
                                   inputs[0].header(name)[1])
      return sum(blocks[1:], blocks[0].copy())

    # The merge's own reads, threads and writes, a numpy sum in place of the merge.
    pipeline.write_streamed(os.path.join(output, hf.SINGLE), entries, lambda name: name, add,
                            checkpoints.Plan.prefetch)
  else:
    checkpoints.merge(base, models, output, checkpoints.Plan(what, SETTINGS.get(what, {})),
                      overwrite=True)
  return {'seconds': time.time() - start, 'peak_rss_bytes': _peak_rss()}


def _peak_rss() -> int:
  """This process's peak resident memory (VmHWM: unlike getrusage's maxrss, not inherited from
  the parent this process was forked from)."""
  with open('/proc/self/status') as f:
    line = next(line for line in f if line.startswith('VmHWM:'))
  return int(line.split()[1]) * 1024


def run(config, workdir: str) -> dict:
  del config
  base, models = make_fixture(os.path.join(workdir, 'checkpoint_fixture'))
  largest = SHAPE['vocab'] * SHAPE['hidden'] * 4  # the embedding, float32
  results = {}
  for repeat in range(max(REPEATS.values())):
    for what in [w for w, count in REPEATS.items() if repeat < count]:
      output = os.path.join(workdir, 'checkpoint_merged', what)
      code = ('import json, sys; from merging.jobs import checkpoint_benchmark as b; print('
              'json.dumps(b.measure(*sys.argv[1:3], sys.argv[3].split(","), sys.argv[4])))')
      proc = subprocess.run([sys.executable, '-c', code, what, base, ','.join(models), output],
                            capture_output=True, text=True, check=True)
      run = json.loads(proc.stdout.strip().splitlines()[-1])
      if what not in results or run['seconds'] < results[what]['seconds']:
        results[what] = run
  floor = results['floor']['seconds']
  lines = ['method            wall s   × floor   peak RSS MB   × largest tensor']
  for what, r in results.items():
    r['floor_ratio'] = r['seconds'] / floor
    r['largest_tensor_ratio'] = r['peak_rss_bytes'] / largest
    lines.append(f'{what:16} {r["seconds"]:7.1f} {r["floor_ratio"]:9.2f} '
                 f'{r["peak_rss_bytes"] / 2**20:13.0f} {r["largest_tensor_ratio"]:18.1f}')
  print('\n'.join(lines))
  summary = {'fixture': SHAPE, 'largest_tensor_bytes': largest, 'results': results}
  atomic.write_json(os.path.join(workdir, 'checkpoint_benchmark.json'), summary)
  return summary
