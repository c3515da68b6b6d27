"""The regimes benchmark: every regime's step timed, its memory and FLOPs read from the compiled
program, MFU against the peak given."""

from configs import quickstart
from editing.jobs import benchmark


def test_the_benchmark_reports_flops_and_mfu_against_a_given_peak(tmp_path):
  config = quickstart.get_config('tiny')
  config.benchmark.update(steps=2, image_size=48, peak_flops=1e12)
  result = benchmark.run(config, str(tmp_path))
  assert result['image_size'] == 48
  full = result['regimes']['full']
  assert set(result['regimes']) == {'full', 'attention_only', 'linearized', 'talos'}
  for r in result['regimes'].values():
    assert r['flops_per_step'] > 0 and r['memory_bytes'] > 0
    assert r['mfu'] == r['flops_per_s'] / 1e12
  # Attention-only differentiates fewer weights: fewer FLOPs than the full step; the linearized
  # step adds a forward-mode pass: more.
  assert result['regimes']['attention_only']['flops_per_step'] < full['flops_per_step']
  assert result['regimes']['linearized']['flops_per_step'] > full['flops_per_step']


def test_known_accelerators_have_their_bf16_peak():
  assert benchmark.peak_flops('NVIDIA H200') == 989e12
  assert benchmark.peak_flops('TPU v4') == 275e12
  assert benchmark.peak_flops('cpu') is None
