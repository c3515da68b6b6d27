r"""Merges the workdir's task vectors with each configured method, choosing its settings and λ
on validation, and evaluates each merge (`merging.jobs.merge`).

  python -m launch.merge --config=configs/merge.py [--workdir=workdir/quickstart]
  python -m launch.merge --config=configs/merge.py --config.merge.methods=ties \
      --config.sweep.ties.density='(0.1,0.2)' --config.ties.scope=tensor
"""

from configs import merge as merge_config
from editing.jobs import cli
from merging.jobs import merge

if __name__ == '__main__':
  cli.run(merge.run, merge_config)
