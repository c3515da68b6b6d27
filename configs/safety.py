r"""Backdoors through merging: 1 and 2 poisoned tasks, BadNets and Blended, every defense, 3 seeds.

  python -m launch.safety --config=configs/safety.py --workdir=workdir/safety
  python -m launch.safety --config=configs/safety.py --config.sweep.seed='(0,)' \
      --config.safety.methods=task_arithmetic,dam
  python -m launch.safety --config=configs/safety.py:tiny --workdir=/tmp/safety_tiny

Derived from configs/merge.py: the same backbone, fine-tuning and method sections (so a merge
here is chosen as in launch.merge). Three of the suite's tasks and short learned merges
(50 steps) keep the whole run to about two and a half hours on 2 CPU cores;
`--config.suite.tasks` takes any of the tasks, and the step counts can be raised.
"""

import ml_collections

from configs import merge


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = merge.get_config(arg)
  if arg != 'tiny':
    config.suite.tasks = 'digits,letters,count'

  # Scenarios: with each trigger, the first n victims (n in poisoned_counts) are poisoned
  # (config.poison: rate, target) and the other tasks are clean; `dam_oracle` is DAM given the
  # true trigger.
  config.safety = ml_collections.ConfigDict(dict(
      victims='digits,letters',
      poisoned_counts='1,2',
      triggers='badnets,blended',
      methods='task_arithmetic,ties,dare,adamerging_task,adamerging_layer,dam,dam_shared,'
              'dam_safe,dam_oracle',
  ))

  # The attack, strong enough to test a defense on this suite: each poisoned model reaches an
  # ASR ≥ 90% within 2 points of its clean fine-tune's accuracy. Poisoning 10% cost digits 5
  # points of clean accuracy in 100 steps, and Blended at ratio 0.15 stayed under 90% ASR.
  config.poison.rate = 0.05
  config.blended.ratio = 0.3

  # Each seed of the sweep config.sweep.seed draws fine-tuning's data order, the poisoned
  # examples and the merges' keys: it sets the seeds of finetune, poison and merge, unset here.
  for section in ('finetune', 'poison', 'merge'):
    del config[section]['seed']
    config[section].seed = ml_collections.config_dict.placeholder(int)
  config.sweep.seed = (0, 1, 2)

  # One setting per method (no grid) and short learned merges, for the CPU budget: TIES keeps
  # the top 20% (its paper's default), DARE drops half; λ is still chosen on validation.
  config.sweep.ties.density = config.sweep.dare.p = None
  config.adamerging_task.steps = 50
  config.adamerging_layer.steps = 50

  config.dam.update(steps=50, refit_steps=50)

  if arg == 'tiny':
    config.suite.tasks = 'digits,colour,size'
    config.safety.update(victims='digits,colour', triggers='badnets,blended')
    config.sweep.seed = (0, 1)
    config.adamerging_task.steps = config.adamerging_layer.steps = 2
  return config
