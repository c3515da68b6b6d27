r"""The negation of a behaviour on the text suite's decoder (`editing.jobs.behaviour`).

  python -m launch.behaviour --config=configs/behaviour.py --workdir=workdir/behaviour
  python -m launch.behaviour --config=configs/behaviour.py:tiny --workdir=/tmp/behaviour

Derived from configs/text_quickstart.py: the same shipped decoder θ0 and tokenizer.
"""

import ml_collections

from configs import text_quickstart
from editing import settings
from editing.jobs import behaviour


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = text_quickstart.get_config()

  # θ_base: θ0 trained further on general text with `behaviour.share` of it offensive; τ:
  # θ_base fine-tuned on offensive sentences alone. The λ grid, the sampling and the
  # tolerance of perplexity: editing/jobs/behaviour.py.
  config.base = text_quickstart.quickstart.training(
      steps=300, batch_size=64, learning_rate=1e-3, weight_decay=0.0, warmup_steps=20,
      checkpoint_every=100, log_every=50)
  config.finetune.update(steps=100, learning_rate=1e-3)
  config.behaviour = settings.defaults(behaviour.BEHAVIOUR)

  if arg == 'tiny':
    config.base.update(steps=8, batch_size=16, warmup_steps=2, checkpoint_every=4,
                       log_every=4)
    config.finetune.update(steps=8, batch_size=16, warmup_steps=2, checkpoint_every=4,
                           log_every=4)
    config.behaviour.update(base_sentences=256, sentences=128, samples=16, lambda_step=0.5,
                            text_size=32)
  elif arg:
    raise ValueError(f'unknown config argument {arg!r}; use none or "tiny"')
  return config
