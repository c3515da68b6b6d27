r"""Benchmarks, each measured as ratios in one run.

  python -m launch.benchmark [--config.benchmark.steps=20]
      the fine-tuning step of every regime: time and memory (`editing.jobs.benchmark`);
      writes <workdir>/benchmark.json
  python -m launch.benchmark --config.benchmark.job=merge_checkpoints
      streaming checkpoint merges against the I/O floor on a generated Llama-shaped fixture
      (`merging.jobs.checkpoint_benchmark`); writes <workdir>/checkpoint_benchmark.json
  python -m launch.benchmark --config.benchmark.job=mergekit \
      --config.benchmark.mergekit=/path/to/bin/mergekit-yaml
      each mergekit recipe through mergekit and editmerge: their difference and time
      (`merging.mergekit.parity`); writes <workdir>/mergekit_parity.json
  python -m launch.benchmark --config=configs/decoder_benchmark.py[:llama_1b]
      a decoder language model's forward pass, training step and generation, against
      PyTorch eager and the device's peak (`editing.jobs.decoder_benchmark`); writes
      <workdir>/decoder_benchmark.json
"""

from configs import quickstart as quickstart_config
from editing import registry
from editing.jobs import benchmark
from editing.jobs import cli
from editing.jobs import decoder_benchmark
from merging.jobs import checkpoint_benchmark
from merging.mergekit import parity as mergekit_parity

JOBS = {'regimes': benchmark.run, 'merge_checkpoints': checkpoint_benchmark.run,
        'mergekit': mergekit_parity.run, 'decoder': decoder_benchmark.run}


def run(config, workdir: str):
  """The benchmark `config.benchmark.job` names."""
  return registry.lookup(JOBS, config.benchmark.job, 'benchmark job')(config, workdir)


if __name__ == '__main__':
  cli.run(run, quickstart_config)
