r"""Scores decoder checkpoints side by side: perplexity, multiple choice, exact match
(`editing.jobs.evaluate_checkpoint`).

  python -m launch.evaluate_checkpoint --workdir=workdir/scores \
      --config.checkpoints=/models/base,/models/merged --config.perplexity.file=wiki.txt

Writes <workdir>/checkpoint_scores.json and checkpoint_scores.md, and prints the table.
"""

from configs import evaluate_checkpoint as evaluate_checkpoint_config
from editing.jobs import cli
from editing.jobs import evaluate_checkpoint

if __name__ == '__main__':
  cli.run(evaluate_checkpoint.run, evaluate_checkpoint_config)
