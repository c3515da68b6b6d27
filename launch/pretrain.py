r"""Pretrains the suite's backbone θ0 on the control task (`editing.jobs.pretrain`).

  python -m launch.pretrain --workdir=workdir/quickstart [--config=configs/quickstart.py[:tiny]]
"""

from configs import quickstart as quickstart_config
from editing.jobs import cli
from editing.jobs import pretrain

if __name__ == '__main__':
  cli.run(pretrain.run, quickstart_config)
