r"""The whole chain on the built-in suite: pretrain (once), fine-tune every task in every
configured regime, evaluate (`editing.jobs.quickstart`).

  pip install -e . && python -m launch.quickstart
  python -m launch.quickstart --config.regimes=full,attention_only,linearized,talos
  python -m launch.quickstart --config=configs/quickstart.py:tiny --workdir=/tmp/tiny

Prints the addition/negation table and writes <workdir>/results.json and report.md (and per
regime, <workdir>/evaluation/<regime>/).
"""

from configs import quickstart as quickstart_config
from editing.jobs import cli
from editing.jobs import quickstart

if __name__ == '__main__':
  cli.run(quickstart.run, quickstart_config)
