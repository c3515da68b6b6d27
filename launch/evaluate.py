r"""Evaluates the task vectors of every configured regime: single-task accuracy, task addition,
task negation and weight disentanglement (`editing.jobs.evaluate`).

  python -m launch.evaluate --workdir=workdir/quickstart [--config.regimes=full,talos]

Writes <workdir>/evaluation/<regime>/{results.json, report.md, alpha_curves.png,
disentanglement.png} per regime and <workdir>/results.json and report.md over all of them.
"""

from configs import quickstart as quickstart_config
from editing.jobs import cli
from editing.jobs import evaluate

if __name__ == '__main__':
  cli.run(evaluate.run, quickstart_config)
