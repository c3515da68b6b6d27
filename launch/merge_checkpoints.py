r"""Merges Hugging Face checkpoints of any size, a tensor at a time (`merging.checkpoints`).

  python -m launch.merge_checkpoints --config.base=/models/base \
      --config.models=/models/a,/models/b --config.method=ties --config.output=/models/merged

A rerun after a kill keeps the finished shards and writes the same bytes; an existing output
that is not this merge's own is refused unless --config.overwrite=True.
"""

from configs import merge_checkpoints as merge_checkpoints_config
from editing.jobs import cli
from merging import checkpoints

if __name__ == '__main__':
  cli.run(checkpoints.run, merge_checkpoints_config, locks_workdir=False)
