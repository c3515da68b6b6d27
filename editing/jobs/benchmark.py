"""Measures the fine-tuning step of every regime, in one process: time, memory and MFU.

Builds the same jitted step the training loop runs (`editing.train.prepare`) for each regime on
one batch of the suite's images (`config.benchmark.task`, drawn from `config.benchmark.seed`;
TaLoS with its mask calibrated on that batch), or of random images of
`config.benchmark.image_size` pixels for a model shaped like a real one (ViT-B/16 at 224), and
compiles each, then times the regimes' steps interleaved (one step of each in turn), so that
machine noise hits them alike. Memory is XLA's buffer assignment of the compiled step on one
device (arguments + outputs − donated aliases + temporaries), the same measure on CPU, GPU and
TPU. Model FLOPs per step are XLA's cost analysis of the compiled step (one device's share)
times the devices of the mesh; MFU is those FLOPs per second over the devices' peak
(`config.benchmark.peak_flops` per device, else the dense bf16 peak of a known accelerator, else
none).

Two peers are timed in the same run, as ratios:
- on a CPU with torch installed and `config.benchmark.torch`, the same step of the full and
  linearized regimes in eager PyTorch (`torch_reference`, its forward checked against the
  JAX model's), interleaved with the JAX steps;
- the evaluator's images per second on `config.benchmark.eval_batches` batches of
  `config.eval.batch_size` (an edit applied, predictions on the host) against the bare jitted
  forward pass of the same batches.

Prints a table and writes <workdir>/benchmark.json.
"""

import importlib.util
import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from editing import atomic
from editing import regimes
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from editing.jobs import checks
from editing.jobs import experiment
from editing.models import head as head_lib
from editing.task_vector import TaskVector


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Times `config.benchmark.steps` steps of every regime; writes <workdir>/benchmark.json."""
  checks.validate(config)
  settings = config.benchmark
  module, apply_fn = experiment.model(config.model)
  task = suite.load_task(settings.task, seed=settings.seed,
                         train_size=config.finetune.batch_size * 2, test_size=8)
  images, labels = task.train.batch(np.arange(config.finetune.batch_size))
  if settings.image_size:
    rng = np.random.default_rng(settings.seed)
    images = rng.uniform(size=(len(images), settings.image_size, settings.image_size, 3))
    images = images.astype(np.float32)
  key_init, key_head, key_mask = jax.random.split(jax.random.PRNGKey(settings.seed), 3)
  theta0 = module.init(key_init, images[:1])['params']
  head = jax.random.normal(key_head, (task.num_classes, config.model.embed_dim))

  mesh = experiment.mesh(config)
  devices = mesh.size
  prepared, placed, memory, flops = {}, {}, {}, {}
  for name in regimes.REGISTRY:
    regime = experiment.regime(config, name)
    update_mask = regime.update_mask(
        theta0, logits_fn=head_lib.logits_fn(regime.encoder(apply_fn), theta0, head,
                                             config.head.logit_scale),
        images=images, key=key_mask)
    initial = regime.initial(theta0, key_init)
    p = train.prepare(config.finetune,
                      loss_fn=head_lib.frozen_head_loss(regime.training_encoder(apply_fn),
                                                        config.head.logit_scale),
                      params=initial, trainable=regime.trainable(initial),
                      consts={'theta0': theta0, 'head': head_lib.padded(head)}, mesh=mesh,
                      sharding_rules=experiment.sharding_rules(config), update_mask=update_mask)
    placed[name] = jax.device_put((images, labels), p.batch_sharding)
    compiled = p.step.lower(p.state, p.inputs, *placed[name]).compile()
    memory[name] = _step_bytes(compiled.memory_analysis())
    flops[name] = step_flops(compiled, devices)
    prepared[name] = p

  steps = {name: _jax_step(p, placed[name]) for name, p in prepared.items()}
  peers = {}
  if (settings.torch and jax.default_backend() == 'cpu' and importlib.util.find_spec('torch')
      and config.model.get('dtype', 'float32') == 'float32'):
    peers = _torch_steps(config, theta0, head, images, labels, apply_fn)
  elif settings.torch:
    logging.info('PyTorch reference skipped: it runs in float32 on a CPU with torch installed')
  timings = {name: [] for name in {**steps, **peers}}
  for _ in range(settings.steps + 1):
    for name, step in {**steps, **peers}.items():
      start = time.perf_counter()
      step()
      timings[name].append(time.perf_counter() - start)

  step_s = {name: float(np.median(t[1:])) for name, t in timings.items()}
  peak = settings.peak_flops or peak_flops(jax.devices()[0].device_kind)
  result = {'params': tree_lib.num_params(theta0), 'batch_size': config.finetune.batch_size,
            'image_size': images.shape[1], 'devices': devices,
            'backend': jax.default_backend(), 'device_kind': jax.devices()[0].device_kind,
            'peak_flops_per_device': peak, 'regimes': {
                name: {'median_step_s': step_s[name],
                       'images_per_s': config.finetune.batch_size / step_s[name],
                       'step_time_ratio': step_s[name] / step_s['full'],
                       'memory_bytes': memory[name],
                       'memory_ratio': memory[name] / memory['full'] if memory['full'] else None,
                       'flops_per_step': flops[name],
                       'flops_per_s': flops[name] / step_s[name],
                       'mfu': mfu(flops[name], step_s[name], peak, devices)}
                for name in prepared},
            'torch': {regime: {'median_step_s': step_s[f'torch_{regime}'],
                               'images_per_s': config.finetune.batch_size / step_s[
                                   f'torch_{regime}'],
                               'speedup': step_s[f'torch_{regime}'] / step_s[regime]}
                      for regime in TORCH_REGIMES if f'torch_{regime}' in step_s},
            'evaluation': evaluation_throughput(config, theta0, apply_fn, images.shape[1:],
                                                task.num_classes)}
  print(_table(result))
  atomic.write_json(os.path.join(workdir, 'benchmark.json'), result)
  return result


# The regimes the PyTorch reference has: f, and f_lin through torch.func.jvp.
TORCH_REGIMES = ('full', 'linearized')


def _jax_step(prepared: train.Prepared, batch):
  """A callable that runs one step on `batch` and waits for it."""
  state = [prepared.state]

  def step():
    state[0], metrics = prepared.step(state[0], prepared.inputs, *batch)
    jax.block_until_ready(metrics['loss'])

  return step


def _torch_steps(config, theta0, head, images, labels, apply_fn) -> dict:
  """{'torch_<regime>': step} of the eager PyTorch reference, on all the host's cores."""
  import torch  # pylint: disable=g-import-not-at-top
  from editing.jobs import torch_reference  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  expected = jax.jit(apply_fn)(theta0, images)
  return {f'torch_{regime}': torch_reference.Step(
      theta0, head, images, labels, model=config.model, expected=expected,
      logit_scale=config.head.logit_scale, learning_rate=config.finetune.learning_rate,
      weight_decay=config.finetune.weight_decay, grad_clip=config.finetune.grad_clip,
      linearized=regime == 'linearized') for regime in TORCH_REGIMES}


def evaluation_throughput(config, theta0, apply_fn, image_shape, num_classes: int) -> dict:
  """Images per second of the evaluator (an edit, one feature pass, heads on the host) and of
  the bare jitted forward pass over the same random images, timed alternately; the median of
  `config.benchmark.steps` rounds each."""
  settings, size = config.benchmark, config.eval.batch_size
  rng = np.random.default_rng(settings.seed)
  images = rng.integers(0, 256, (size * settings.eval_batches,) + tuple(image_shape),
                        dtype=np.uint8)
  data = suite.Dataset(images, rng.integers(0, num_classes, len(images)).astype(np.int32))
  evaluator = experiment.evaluator(config, apply_fn, 'full')
  head = jax.random.normal(jax.random.PRNGKey(settings.seed), (num_classes,
                                                               config.model.embed_dim))
  vector = TaskVector(jax.tree.map(lambda x: 0.01 * x, theta0), ('bench',), 'full', 'bench')
  forward = jax.jit(apply_fn)
  batches = [jax.device_put(data.batch(np.arange(i, i + size))[0])
             for i in range(0, len(data), size)]

  def through_evaluator():
    evaluator.accuracy(theta0, evaluator.edit(theta0, vector, 0.5), head, data)

  def bare_forward():
    jax.block_until_ready([forward(theta0, x) for x in batches])

  timings = {'evaluator': [], 'forward': []}
  for _ in range(settings.steps + 1):
    for name, fn in (('evaluator', through_evaluator), ('forward', bare_forward)):
      start = time.perf_counter()
      fn()
      timings[name].append(time.perf_counter() - start)
  seconds = {name: float(np.median(t[1:])) for name, t in timings.items()}
  return {'batch_size': size, 'images': len(data),
          **{f'{name}_images_per_s': len(data) / s for name, s in seconds.items()},
          'slowdown': seconds['evaluator'] / seconds['forward']}


# Dense bf16 peak FLOP/s per device of the accelerators the project targets, by device kind.
PEAK_FLOPS = (('H200', 989e12), ('H100', 989e12), ('A100', 312e12), ('TPU v4', 275e12),
              ('TPU v5 lite', 197e12), ('TPU v5e', 197e12))


def peak_flops(device_kind: str) -> float | None:
  """The dense bf16 peak of a known accelerator, None for any other device (a CPU)."""
  for name, peak in PEAK_FLOPS:
    if name.lower() in device_kind.lower():
      return peak
  return None


def step_flops(compiled: jax.stages.Compiled, devices: int) -> float:
  """The FLOPs of one run of a compiled program on all its `devices`.

  XLA's cost analysis counts the program one device runs (its partition of the SPMD program),
  so the whole run is `devices` times that; work replicated across devices counts on each.
  """
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  return devices * float((analysis or {}).get('flops', 0.0))


def mfu(flops: float, seconds: float, peak: float | None, devices: int) -> float | None:
  """The share of `devices` devices' peak (`peak` FLOP/s each) that `flops` FLOPs in `seconds`
  use; None without a peak."""
  return flops / seconds / (peak * devices) if peak else None


def _step_bytes(analysis) -> int:
  """Arguments + outputs − donated aliases + temporaries of a compiled program, in bytes."""
  if analysis is None:
    return 0
  return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
             - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)


def _table(result: dict) -> str:
  lines = [f'{result["params"]:,} params, batch {result["batch_size"]} at '
           f'{result["image_size"]} px, {result["devices"]} {result["device_kind"]} device(s)',
           f'{"regime":>15} {"step ms":>8} {"img/s":>7} {"time/full":>9} {"MiB":>7} '
           f'{"mem/full":>8} {"GFLOP":>8} {"TFLOP/s":>8} {"MFU":>6}']
  for name, r in result['regimes'].items():
    ratio, mfu = r['memory_ratio'], r['mfu']
    lines.append(f'{name:>15} {1e3 * r["median_step_s"]:8.1f} {r["images_per_s"]:7.0f} '
                 f'{r["step_time_ratio"]:9.2f} {r["memory_bytes"] / 2**20:7.1f} '
                 f'{"–" if ratio is None else f"{ratio:.2f}":>8} '
                 f'{r["flops_per_step"] / 1e9:8.1f} {r["flops_per_s"] / 1e12:8.3f} '
                 f'{"–" if mfu is None else f"{100 * mfu:.1f}%":>6}')
  for regime, r in result['torch'].items():
    lines.append(f'{regime}: PyTorch eager {r["images_per_s"]:.0f} img/s; editmerge is '
                 f'{r["speedup"]:.2f}x as fast')
  e = result['evaluation']
  lines.append(f'evaluation at batch {e["batch_size"]}: {e["evaluator_images_per_s"]:.0f} img/s '
               f'through the evaluator, {e["forward_images_per_s"]:.0f} img/s bare forward '
               f'({e["slowdown"]:.2f}x the forward\'s time)')
  return '\n'.join(lines)

