"""The regimes benchmark: every regime's step timed, its memory and FLOPs read from the compiled
program, MFU against the peak given."""

import json
import os
import subprocess

import jax
import numpy as np
import pytest

from configs import decoder_benchmark as decoder_config
from configs import quickstart
from editing import regimes
from editing.jobs import benchmark
from editing.jobs import decoder_benchmark
from editing.jobs import experiment
from tests.conftest import REPO, run_python, xla_flags


def test_the_benchmark_reports_flops_and_mfu_against_a_given_peak(tmp_path):
  config = quickstart.get_config('tiny')
  config.benchmark.update(steps=2, image_size=48, peak_flops=1e12)
  result = benchmark.run(config, str(tmp_path))
  assert result['image_size'] == 48
  full = result['regimes']['full']
  assert set(result['regimes']) == set(regimes.REGISTRY)
  for r in result['regimes'].values():
    assert r['flops_per_step'] > 0 and r['memory_bytes'] > 0
    assert 0 < r['mfu'] < 1
  # Attention-only differentiates fewer weights: fewer FLOPs than the full step; the linearized
  # step adds a forward-mode pass: more.
  assert result['regimes']['attention_only']['flops_per_step'] < full['flops_per_step']
  assert result['regimes']['linearized']['flops_per_step'] > full['flops_per_step']
  # LoRA computes no gradient of θ0's weights, only of the small factors.
  assert result['regimes']['lora']['flops_per_step'] < full['flops_per_step']
  # The PyTorch reference ran (its forward matched the JAX model's, or it would have raised),
  # and the evaluator was timed against the bare forward pass over the same images.
  assert set(result['torch']) == {'full', 'linearized'}
  assert all(r['images_per_s'] > 0 and r['speedup'] > 0 for r in result['torch'].values())
  evaluation = result['evaluation']
  assert evaluation['images'] == config.benchmark.eval_batches * config.eval.batch_size
  assert evaluation['evaluator_images_per_s'] > 0 and evaluation['slowdown'] > 0


SHARDED_MATMUL = r'''
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from editing.jobs import benchmark
from editing.jobs import decoder_benchmark
from editing.jobs import experiment

mesh = jax.make_mesh((8,), ('rows',))
m, k, n = 256, 128, 64
a = jax.device_put(jnp.ones((m, k)), NamedSharding(mesh, P('rows')))
b = jax.device_put(jnp.ones((k, n)), NamedSharding(mesh, P()))
compiled = jax.jit(jnp.matmul, out_shardings=NamedSharding(mesh, P('rows'))).lower(a, b).compile()
flops = benchmark.step_flops(compiled, mesh.size)
json.dump({'flops': flops, 'per_device': compiled.cost_analysis()['flops'],
           'mfu': benchmark.mfu(flops, 1e-3, 1e9, mesh.size)}, sys.stdout)
'''


def test_flops_and_mfu_of_a_matmul_split_over_eight_devices():
  out = json.loads(run_python(
      ['-c', SHARDED_MATMUL],
      env={'XLA_FLAGS': xla_flags(devices=8)}).stdout)
  # (256 × 128) @ (128 × 64): 2·M·K·N = 4,194,304 FLOPs in all, an eighth on each device.
  assert out['per_device'] == 4194304 / 8
  assert out['flops'] == 4194304
  # Those FLOPs in 1 ms are 4.194304 GFLOP/s, of the 8 GFLOP/s of 8 devices of 1 GFLOP/s each.
  np.testing.assert_allclose(out['mfu'], 0.524288, rtol=1e-12)


def test_known_accelerators_have_their_bf16_peak():
  assert benchmark.peak_flops('NVIDIA H200') == 989e12
  assert benchmark.peak_flops('TPU v4') == 275e12
  assert benchmark.peak_flops('cpu') is None


def test_an_unknown_benchmark_job_is_named_with_the_known_ones(tmp_path):
  proc = run_python(['-m', 'launch.benchmark', '--config.benchmark.job=regime',
                     f'--workdir={tmp_path}'], check=False)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].endswith(
      "unknown benchmark job 'regime'; known: ['decoder', 'merge_checkpoints', 'mergekit', "
      "'regimes']"), \
      proc.stderr


def test_the_decoder_benchmark_counts_the_models_flops_and_times_pytorch_beside_it(tmp_path):
  config = decoder_config.get_config('tiny')
  config.benchmark.peak_flops = 1e12
  result = decoder_benchmark.run(config, str(tmp_path))
  # The tiny Llama by hand: a tied 256 × 32 table, and per layer q, o (32 × 32), k, v
  # (32 × 16: 2 of 4 heads), gate, up, down (32 × 64) and two norms; the final norm.
  layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
  assert result['params'] == 256 * 32 + 2 * layer + 32
  tokens = config.benchmark.batch_size * config.benchmark.length
  attention = 4 * 2 * 4 * 8 * config.benchmark.length  # 4·L·H·d·S
  forward, train = result['steps']['forward'], result['steps']['train']
  assert forward['flops'] == tokens * (2 * result['params'] + attention)
  assert train['flops'] == 3 * forward['flops']
  for step in (forward, train):
    assert step['mfu'] == pytest.approx(step['flops'] / step['median_s'] / 1e12)
    assert step['speedup_over_torch'] > 0 and step['xla_flops'] > 0
  assert result['generation']['tokens_per_s'] > 0
  assert result['generation']['speedup_over_torch'] > 0
  assert json.loads((tmp_path / 'decoder_benchmark.json').read_text())['params'] == \
      result['params']


def test_the_pytorch_reference_trains_the_same_model_as_the_jax_step():
  import torch  # pylint: disable=g-import-not-at-top
  from editing.jobs import torch_reference  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  config = quickstart.get_config('tiny')
  module, apply_fn = experiment.model(config.model)
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(4, 32, 32, 3)).astype(np.float32)
  theta0 = module.init(jax.random.PRNGKey(0), images[:1])['params']
  expected = np.asarray(apply_fn(theta0, images))
  with pytest.raises(AssertionError, match='does not compute the JAX model'):
    torch_reference.Step(theta0, np.eye(3, 32), images, [0, 1, 2, 0], model=config.model,
                         expected=expected + 0.1, logit_scale=30.0, learning_rate=1e-3,
                         weight_decay=0.1, grad_clip=1.0)
  for linearized in (False, True):
    step = torch_reference.Step(theta0, np.eye(3, 32), images, [0, 1, 2, 0],
                                model=config.model, expected=expected, logit_scale=30.0,
                                learning_rate=1e-3, weight_decay=0.1, grad_clip=1.0,
                                linearized=linearized)
    losses = [step() for _ in range(5)]
    assert losses[-1] < losses[0]


def test_the_gpu_scripts_dry_run_times_a_merge_phase_by_phase_on_the_tiny_fixture(tmp_path):
  """DRY_RUN=1: the merges of launch/benchmark_gpu.sh alone, on the tiny fixture, once each.
  On one CPU device no block is put anywhere (to_device and from_device not timed apart)."""
  proc = subprocess.run(['bash', 'launch/benchmark_gpu.sh'], cwd=REPO, capture_output=True,
                        text=True, timeout=600,
                        env=dict(os.environ, DRY_RUN='1', WORKDIR=str(tmp_path),
                                 MERGES='task_arithmetic', PYTHONPATH=REPO))
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / 'merges' / 'checkpoint_benchmark_tiny.json') as f:
    results = json.load(f)['results']
  assert set(results) == {'floor_3', 'task_arithmetic'}
  merge = results['task_arithmetic']
  assert {'prepare', 'read', 'compute', 'write'} <= set(merge['phase_seconds'])
  assert 'to_device' not in merge['phase_seconds'] and not results['floor_3']['phase_seconds']
  # A base, three fine-tunes and the merge, each of the same size in float32.
  model = sum(os.path.getsize(tmp_path / 'merges' / 'checkpoint_fixture_tiny' / 'base' / f)
              for f in os.listdir(tmp_path / 'merges' / 'checkpoint_fixture_tiny' / 'base')
              if f.endswith('.safetensors'))
  assert merge['bytes_moved'] == 5 * model
  assert merge['gb_per_second'] == pytest.approx(5 * model / merge['seconds'] / 1e9)
  assert 'where the merges\' time went' in proc.stdout
