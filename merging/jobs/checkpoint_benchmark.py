"""Checkpoint merging against the I/O floor, in one run, on a generated Llama-shaped fixture.

The fixture (FIXTURES: 'benchmark', hidden 1024, 8 layers, vocabulary 32,000, MLP 2,048,
grouped key/value heads of 256: about 136M parameters, float32, about 545 MB a model;
'llama_1b', Llama-3.2-1B's shapes in bfloat16; 'tiny', seconds on a CPU) is a base and three
fine-tunes, written once to <workdir>/checkpoint_fixture[_<name>]. Each measurement runs in its own process, so its
peak RSS is its own. `CASES` holds one measurement per streamed method, with the fine-tuned
models it takes (SLERP and the one-model methods fewer), and the floors they are held against:

  floor_<N>   read the base and N fine-tunes once, add them, write the sum: the merge's own
              blocked reads, threads and writes around a numpy sum
  <method>    the method through `merging.checkpoints`, at the settings given (the rest at
              their declared defaults), over the first N fine-tunes
  passthrough the base's first four layers stacked on a fine-tune's last four (mergekit's
              `slices`), against floor_1
  <method>_randomized
              an SVD merge whose kept triplets a randomized sketch finds (`merging.svd`),
              with its output's relative error against the same method's full SVDs

They run in turn, each `runs` times over (the machine's noise moves all of them; the floor's
first read may also find a cold page cache), and each reports its fastest run. Each output is
removed once measured (the 1B fixture's are 2.5 GB each), or, where a sketch's error is
measured against it, at the end. The table
reports wall time, its ratio to the floor of the same inputs, the GB it read and wrote a
second, peak RSS and its ratio to the largest tensor's size (and a sketch's error), then where
each merge's time went (read, to_device, compute, from_device, write; prepare: the rankings,
sums and whole-tensor merges before a tensor's blocks). The fixture's deltas are Gaussian noise, whose
flat spectra are a sketch's hardest case: a fine-tune's decaying spectrum is found closer.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
import safetensors.numpy

from editing import atomic
from editing import registry
from editing.errors import UserError
from editing.models import hf
from editing.models import peft_adapter
from merging import checkpoints
from merging.checkpoints import passthrough
from merging.checkpoints import pipeline


class Case(NamedTuple):
  method: str  # a checkpoint merge's method, 'floor' or 'passthrough'
  settings: dict = {}
  models: int = 3  # the fine-tunes it merges, the first ones of the fixture
  runs: int = 1
  exact: str | None = None  # the case whose output this one's randomized SVDs approximate


# The fast ones run five times, where a tenth of a second of noise moves the ratio; the SVD
# merges and WUDI run for minutes, where it is lost. WUDI runs 10, 40 and its default 400 Adam
# steps: each step of a token table's costs a 32,000 × 1,024 × 1,024 product.
CASES = {
    'floor_3': Case('floor', runs=5),
    'floor_2': Case('floor', models=2, runs=3),
    'floor_1': Case('floor', models=1, runs=3),
    'passthrough': Case('passthrough', models=1, runs=3),
    'averaging': Case('averaging', runs=3),
    'task_arithmetic': Case('task_arithmetic', runs=5),
    'ties': Case('ties', {'density': 0.2, 'scope': 'tensor'}, runs=5),
    'dare_ties': Case('dare', {'p': 0.5, 'then': 'ties', 'density': 1.0, 'scope': 'tensor',
                               'rescale': 'l1_norm'}, runs=3),
    'dare_linear': Case('dare', {'p': 0.5, 'rescale': 'l1_norm'}, runs=3),
    'breadcrumbs_ties': Case('breadcrumbs', {'top': 0.01, 'bottom': 0.19, 'elect_sign': True},
                             runs=3),
    'della': Case('della', {'density': 0.5, 'epsilon': 0.1}, runs=3),
    'sce': Case('sce', {'select_topk': 0.5}, runs=3),
    'consensus': Case('consensus', runs=3),
    'magmax': Case('magmax', runs=3),
    'model_stock': Case('model_stock', runs=3),
    'slerp': Case('slerp', {'t': 0.5}, models=1, runs=3),
    'nuslerp': Case('nuslerp', models=2, runs=3),
    'multislerp': Case('multislerp', runs=3),
    'karcher': Case('karcher', runs=3),
    'nearswap': Case('nearswap', {'t': 1e-3}, models=1, runs=3),
    'arcee_fusion': Case('arcee_fusion', models=1, runs=3),
    'negation': Case('negation', models=1, runs=3),
    'extract_lora': Case('extract_lora', {'rank': 16}, models=1, runs=3),
    'extract_lora_randomized': Case('extract_lora', {'rank': 16, 'svd': 'randomized'},
                                    models=1, runs=3, exact='extract_lora'),
    'tsv_m': Case('tsv_m'),
    'tsv_m_randomized': Case('tsv_m', {'svd': 'randomized'}, exact='tsv_m'),
    'iso_c': Case('iso_c'),
    'iso_cts': Case('iso_cts'),
    'iso_cts_randomized': Case('iso_cts', {'svd': 'randomized'}, exact='iso_cts'),
    'wudi': Case('wudi', {'steps': 10}),
    'wudi_40': Case('wudi', {'steps': 40}),
    'wudi_400': Case('wudi'),
}
SHAPE = dict(hidden=1024, layers=8, vocab=32000, mlp=2048, kv=256)
# The fixtures by name: their shapes, and where they differ from SHAPE's defaults their head
# size, tied token table and dtype. llama_1b has Llama-3.2-1B's shapes (1.24B parameters, the
# head tied to the token table), in bfloat16: about 2.5 GB a model, 10 GB written once.
FIXTURES = {'benchmark': SHAPE, 'tiny': dict(hidden=64, layers=2, vocab=256, mlp=128, kv=16),
            'llama_1b': dict(hidden=2048, layers=16, vocab=128256, mlp=8192, kv=512, head=64,
                             tied=True, dtype='bfloat16')}


def fixture_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
  """{tensor name: its shape} of a Llama of `shape`, as Hugging Face names them."""
  h = shape['hidden']
  shapes = {'model.embed_tokens.weight': (shape['vocab'], h), 'model.norm.weight': (h,)}
  if not shape.get('tied'):
    shapes['lm_head.weight'] = (shape['vocab'], h)
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
  return shapes


def fixture_tensors(seed: int, base: dict | None = None,
                    shape: dict = SHAPE) -> dict[str, np.ndarray]:
  """A base (θ0 ~ N(0, 0.02²)) or, given it, a fine-tune θ0 + N(0, 0.001²), in the shape's
  dtype (the noise drawn in float32)."""
  rng = np.random.default_rng(seed)
  dtype = ml_dtypes.bfloat16 if shape.get('dtype') == 'bfloat16' else np.float32
  out = {}
  for name, size in fixture_shapes(shape).items():
    noise = rng.standard_normal(size, np.float32)
    x = noise * 0.02 if base is None else base[name].astype(np.float32) + 0.001 * noise
    out[name] = x.astype(dtype, copy=False)
  return out


def make_fixture(directory: str, shape: dict = SHAPE) -> tuple[str, list[str]]:
  base_dir = os.path.join(directory, 'base')
  models = [os.path.join(directory, f'ft{k}') for k in range(3)]
  if not all(os.path.exists(os.path.join(d, hf.SINGLE)) for d in [base_dir] + models):
    # The Llama config mergekit reads the layer count and sizes from.
    head = shape.get('head', 16)
    config = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
              'hidden_size': shape['hidden'], 'num_hidden_layers': shape['layers'],
              'intermediate_size': shape['mlp'], 'vocab_size': shape['vocab'],
              'num_attention_heads': shape['hidden'] // head,
              'num_key_value_heads': shape['kv'] // head,
              'tie_word_embeddings': bool(shape.get('tied')),
              'torch_dtype': shape.get('dtype', 'float32')}
    base = fixture_tensors(0, shape=shape)
    hf.save(base_dir, base, config, shard_bytes=2**40)
    for k, path in enumerate(models):
      hf.save(path, fixture_tensors(k + 1, base, shape), config, shard_bytes=2**40)
  return base_dir, models


def measure(name: str, base: str, models: list[str], output: str) -> dict:
  """CASES[name] in this process: seconds, peak RSS, the bytes it read and wrote, and where a
  merge's time went (`pipeline.Phases`). The clock starts once JAX's backend is up, a cost of
  the process (like its imports), not of the merge."""
  case = CASES[name]
  models = models[:case.models]
  jax.devices()
  phases = {}
  start = time.time()
  if case.method == 'floor':
    inputs = [hf.Checkpoint(p) for p in [base] + models]
    entries = [(n, *inputs[0].header(n)) for n in sorted(inputs[0].files)]

    def add(name: str, start: int, stop: int) -> np.ndarray:
      blocks = pipeline.read_block(inputs, name, start, stop, stop - start,
                                   inputs[0].header(name)[1])
      return sum(blocks[1:], blocks[0].copy())

    # The merge's own reads, threads and writes, a numpy sum in place of the merge.
    pipeline.write_streamed(os.path.join(output, hf.SINGLE), entries, lambda name: name, add,
                            checkpoints.Plan.prefetch)
  elif case.method == 'passthrough':
    layers = hf.Checkpoint(base).config['num_hidden_layers']
    half = layers // 2
    passthrough.run([passthrough.Slice(base, 0, half), passthrough.Slice(models[0], half, layers)],
                    output, overwrite=True)
  else:
    phases = checkpoints.merge(base, models, output, checkpoints.Plan(
        case.method, case.settings), overwrite=True).get('phase_seconds', {})
  seconds = time.time() - start
  moved = sum(_safetensors_bytes(d) for d in [base] + models + [output])
  return {'seconds': seconds, 'peak_rss_bytes': _peak_rss(), 'bytes_moved': moved,
          'phase_seconds': phases}


def _safetensors_bytes(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
             if f.endswith('.safetensors'))


def relative_error(approximate: str, exact: str, base: str) -> float:
  """‖Δ − Δ*‖_F / ‖Δ*‖_F over every tensor: Δ what the approximate case wrote and Δ* what the
  exact one did, each a merged checkpoint's change from the base or an adapter's B A."""
  adapter = os.path.join(exact, peft_adapter.ADAPTER)
  if os.path.exists(adapter):
    changes = lambda d: _adapter_products(os.path.join(d, peft_adapter.ADAPTER))
  else:
    theta0 = hf.Checkpoint(base)
    changes = lambda d: {n: hf.Checkpoint(d).tensor(n).astype(np.float64) - theta0.tensor(n)
                         for n in theta0.files}
  ours, reference = changes(approximate), changes(exact)
  gap = sum(np.sum((ours[n] - reference[n]) ** 2) for n in reference)
  return float(np.sqrt(gap / sum(np.sum(x ** 2) for x in reference.values())))


def _adapter_products(path: str) -> dict[str, np.ndarray]:
  """{module: B A} of a LoRA adapter's factored modules, in float64."""
  tensors = safetensors.numpy.load_file(path)
  return {name: tensors[name.replace('lora_A', 'lora_B')].astype(np.float64) @ a
          for name, a in tensors.items() if 'lora_A' in name}


def _peak_rss() -> int:
  """This process's peak resident memory (VmHWM: unlike getrusage's maxrss, not inherited from
  the parent this process was forked from)."""
  with open('/proc/self/status') as f:
    line = next(line for line in f if line.startswith('VmHWM:'))
  return int(line.split()[1]) * 1024


def fixture_directory(name: str) -> str:
  """Where under a workdir the fixture `name` of FIXTURES is written."""
  return 'checkpoint_fixture' if name == 'benchmark' else f'checkpoint_fixture_{name}'


def run(config, workdir: str, shape: dict | None = None, runs: int | None = None) -> dict:
  """Every case of `config.benchmark.recipes` (comma-separated; all: '') and the floors they
  are held against, on the fixture `config.benchmark.fixture` names (default 'benchmark'), or
  one of `shape`, each run its `runs` times (at most `config.benchmark.runs` or `runs`, where
  given); writes <workdir>/checkpoint_benchmark.json (_<fixture>.json for another)."""
  fixture_name = 'shape' if shape is not None else config.benchmark.fixture or 'benchmark'
  if shape is None:
    shape = registry.lookup(FIXTURES, fixture_name, 'config.benchmark.fixture')
  runs = runs or config.benchmark.get('runs') or None
  chosen = [r for r in config.benchmark.recipes.split(',') if r] or list(CASES)
  unknown = sorted(set(chosen) - set(CASES))
  if unknown:
    raise UserError(f'config.benchmark.recipes: {unknown} are not checkpoint benchmark cases; '
                    f'known: {list(CASES)}')
  needed = {f'floor_{CASES[c].models}' for c in chosen} | {CASES[c].exact for c in chosen}
  cases = {c: CASES[c] for c in CASES if c in needed or c in chosen}
  base, models = make_fixture(os.path.join(workdir, fixture_directory(fixture_name)), shape)
  fixture = hf.Checkpoint(base)
  largest = max(math.prod(shape) * dtype.itemsize
                for shape, dtype in map(fixture.header, fixture.files))
  results, errors = {}, {}
  runs_of = {n: min(c.runs, runs or c.runs) for n, c in cases.items()}
  merged = lambda case: os.path.join(workdir, 'checkpoint_merged', case)
  # Each output is removed once measured (a 1B fixture's is 2.5 GB), but those an approximate
  # case is measured against, removed at the end.
  exact = {c.exact for c in cases.values() if c.exact}
  for repeat in range(max(runs_of.values())):
    for name in [n for n in cases if repeat < runs_of[n]]:
      output = merged(name)
      code = ('import json, sys; from merging.jobs import checkpoint_benchmark as b; print('
              'json.dumps(b.measure(*sys.argv[1:3], sys.argv[3].split(","), sys.argv[4])))')
      proc = subprocess.run([sys.executable, '-c', code, name, base, ','.join(models), output],
                            capture_output=True, text=True)
      if proc.returncode:
        raise RuntimeError(f'checkpoint benchmark case {name!r} failed:\n{proc.stderr[-4000:]}')
      measured = json.loads(proc.stdout.strip().splitlines()[-1])
      if name not in results or measured['seconds'] < results[name]['seconds']:
        results[name] = measured
      if repeat == runs_of[name] - 1 and cases[name].exact:
        errors[name] = relative_error(output, merged(cases[name].exact), base)
      if name not in exact:
        shutil.rmtree(output)
  for name in exact:
    shutil.rmtree(merged(name))
  lines = ['case                     models   wall s   × floor    GB/s   peak RSS MB   '
           '× largest tensor   error']
  for name, r in results.items():
    models_merged = cases[name].models
    r['models'] = models_merged
    r['floor_ratio'] = r['seconds'] / results[f'floor_{models_merged}']['seconds']
    r['largest_tensor_ratio'] = r['peak_rss_bytes'] / largest
    error = ''
    if name in errors:
      r['error'] = errors[name]
      error = f'{r["error"]:8.2e}'
    r['gb_per_second'] = r['bytes_moved'] / r['seconds'] / 1e9
    lines.append(f'{name:24} {models_merged:6} {r["seconds"]:8.1f} {r["floor_ratio"]:9.2f} '
                 f'{r["gb_per_second"]:7.2f} {r["peak_rss_bytes"] / 2**20:13.0f} '
                 f'{r["largest_tensor_ratio"]:18.1f} {error}')
  lines.append('where the merges\' time went, seconds summed over their threads (reads, merges '
               'and writes overlap):')
  for name, r in results.items():
    if r['phase_seconds']:
      lines.append(f'  {name:22} ' + '  '.join(f'{phase} {seconds:.2f}' for phase, seconds
                                               in sorted(r['phase_seconds'].items())))
  print('\n'.join(lines))
  summary = {'fixture': shape, 'largest_tensor_bytes': largest,
             'settings': {n: c.settings for n, c in cases.items()}, 'results': results}
  suffix = '' if fixture_name in ('benchmark', 'shape') else f'_{fixture_name}'
  atomic.write_json(os.path.join(workdir, f'checkpoint_benchmark{suffix}.json'), summary)
  return summary
