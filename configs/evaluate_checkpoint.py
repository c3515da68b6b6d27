r"""Scoring decoder checkpoints side by side (`editing.jobs.evaluate_checkpoint`).

  python -m launch.evaluate_checkpoint --workdir=workdir/scores \
      --config.checkpoints=/models/base,/models/merged,/models/smollm2.Q4_1.gguf \
      --config.perplexity.file=wiki.txt --config.multiple_choice.file=arc.jsonl \
      --config.exact_match.file=answers.jsonl

Each evaluation runs where its file is given. A checkpoint is a Hugging Face directory with
its tokenizer.json, or a .gguf file. Writes <workdir>/checkpoint_scores.json and
checkpoint_scores.md, one row per checkpoint.
"""

import ml_collections

from editing import settings
from editing.jobs import evaluate_checkpoint


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  config = ml_collections.ConfigDict()
  config.checkpoints = ''  # comma-separated: Hugging Face directories and .gguf files
  # Perplexity over a .txt, .jsonl or .parquet file, in windows of `window` tokens.
  config.perplexity = settings.defaults(evaluate_checkpoint.PERPLEXITY)
  # Multiple choice from a .jsonl in lm-eval-harness's shapes
  # (editing.jobs.evaluate_checkpoint.read_questions names the keys read).
  config.multiple_choice = settings.defaults(evaluate_checkpoint.MULTIPLE_CHOICE)
  # Exact match of greedy answers to a .jsonl of {"prompt", "answer"}.
  config.exact_match = settings.defaults(evaluate_checkpoint.EXACT_MATCH)
  config.scoring = settings.defaults(evaluate_checkpoint.SCORING)
  return config
