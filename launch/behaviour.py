r"""The negation of a behaviour: offensive continuations against perplexity over λ
(`editing.jobs.behaviour`).

  python -m launch.behaviour --config=configs/behaviour.py --workdir=workdir/behaviour

Writes <workdir>/behaviour/results.json, report.md and frontier.png.
"""

from configs import behaviour as behaviour_config
from editing.jobs import behaviour
from editing.jobs import cli

if __name__ == '__main__':
  cli.run(behaviour.run, behaviour_config)
