r"""Backdoors through merging: poisoned task vectors merged by each method, scored on clean
accuracy and attack success rate (`merging.jobs.safety`).

  python -m launch.safety --config=configs/safety.py --workdir=workdir/safety
  python -m launch.safety --config=configs/safety.py:tiny --workdir=/tmp/safety_tiny

Writes <workdir>/safety/results.json, report.md (mean ± std over seeds) and scatter.png.
"""

from configs import safety as safety_config
from editing.jobs import cli
from merging.jobs import safety

if __name__ == '__main__':
  cli.run(safety.run, safety_config)
