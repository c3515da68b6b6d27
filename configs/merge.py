r"""Merging the suite's task vectors with every method of `merging/`, and evaluating each merge.

  python -m launch.quickstart                      # first: the backbone and the task vectors
  python -m launch.merge --config=configs/merge.py
  python -m launch.merge --config=configs/merge.py --config.merge.methods=ties \
      --config.ties.density='(0.1,0.2,0.3)' --config.ties.scope=tensor
  python -m launch.merge --config=configs/merge.py --config.regimes=attention_only

Derived from configs/quickstart.py (same backbone, suite and task vectors; the same workdir).
A method's setting given as a tuple is a grid axis: every combination is merged and the one
with the best mean normalized validation accuracy is kept, with λ (for the methods that scale
their merge) chosen on the same validation sweep. Each key must be a keyword argument of the
method's merge function (merging/<method>.py), each value of the kind of its default.
"""

import ml_collections

from configs import quickstart


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = quickstart.get_config(arg)

  # Which methods, λ's grid 0, lambda_step, ..., 1 (the step of task addition's α grid: on
  # this suite the best λ is small), and the examples per task that the data-driven methods
  # read (Fisher and RegMean: labeled train; AdaMerging: unlabeled test).
  config.merge = ml_collections.ConfigDict(dict(
      methods='averaging,task_arithmetic,ties,dare,breadcrumbs,consensus,fisher,regmean,'
              'adamerging_task,adamerging_layer,dam',
      lambda_step=0.05,
      seed=0,
      train_examples=256,
  ))

  # Each method's settings (merging/<method>.py); tuples are grids. DAM's ablations
  # (dam_shared, dam_safe, dam_oracle) read config.dam.
  config.ties = ml_collections.ConfigDict(dict(density=(0.1, 0.2), scope=('global',)))
  config.dare = ml_collections.ConfigDict(dict(p=(0.3, 0.6), then=('task_arithmetic',)))
  config.breadcrumbs = ml_collections.ConfigDict(dict(top=(0.01,), bottom=(0.89,)))
  config.consensus = ml_collections.ConfigDict(dict(min_tasks=(2,), tall_lambda=(0.3, 0.5)))
  config.fisher = ml_collections.ConfigDict(dict(batch_size=32))
  config.regmean = ml_collections.ConfigDict(dict(alpha=(0.9,), batch_size=64))
  adamerging = dict(steps=200, learning_rate=1e-3, init=0.3, batch_size=16)
  config.adamerging_task = ml_collections.ConfigDict(adamerging)
  config.adamerging_layer = ml_collections.ConfigDict(adamerging)
  # DAM's masks (merging/dam.py) are learned for `steps`, then λ is refitted for `refit_steps`
  # as in AdaMerging; perturbations live on [0, 1] pixels, ‖δ‖_∞ ≤ bound.
  config.dam = ml_collections.ConfigDict(dict(
      granularity='task', steps=100, refit_steps=100, learning_rate=1e-3, init=0.3,
      batch_size=16, mask_learning_rate=0.02, mask_init=0.0, temperature=0.5, bound=0.2,
      perturbation_step=0.02, safety_weight=1.0))

  if arg == 'tiny':
    config.merge.update(lambda_step=0.5, train_examples=32)
    config.ties.density = (0.2,)
    config.dare.p = (0.5,)
    config.consensus.tall_lambda = (0.5,)
    config.adamerging_task.steps = 3
    config.adamerging_layer.steps = 3
    config.dam.update(steps=2, refit_steps=2)
  return config
