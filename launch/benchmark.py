r"""Measures the fine-tuning step of every regime in one process: time and memory, as ratios
(`editing.jobs.benchmark`).

  python -m launch.benchmark [--config=configs/quickstart.py] [--config.benchmark.steps=20]

Prints a table of median step time, images/s and both ratios to full, and writes
<workdir>/benchmark.json.
"""

from configs import quickstart as quickstart_config
from editing.jobs import benchmark
from editing.jobs import cli

if __name__ == '__main__':
  cli.run(benchmark.run, quickstart_config)
