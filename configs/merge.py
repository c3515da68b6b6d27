r"""Merging the suite's task vectors with every method of `merging/`, and evaluating each merge.

  python -m launch.quickstart                      # first: the backbone and the task vectors
  python -m launch.merge --config=configs/merge.py
  python -m launch.merge --config=configs/merge.py --config.merge.methods=ties \
      --config.sweep.ties.density='(0.1,0.2,0.3)' --config.ties.scope=tensor
  python -m launch.merge --config=configs/merge.py --config.regimes=attention_only

Derived from configs/quickstart.py (same backbone, suite and task vectors; the same workdir).
config.<method> holds the values given to the method's settings, each unset (None) until given;
one left unset takes the default its file declares (merging/<method>.py). config.sweep.<method>
holds its grid, apart from the values: a setting given a tuple there is a grid axis, and a
setting given both a value and an axis is refused (this config's own axes, e.g. TIES' density,
take one value as an axis of one: --config.sweep.ties.density='(0.3,)'). Every combination is
merged and the one with the best mean normalized validation accuracy is kept, with λ (for the
methods that scale their merge) chosen on the same validation sweep.
"""

import ml_collections

import merging
from configs import quickstart
from configs import text_quickstart
from configs import text_smollm2
from editing import settings
from merging.jobs import merge as merge_job


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: comma-separated, 'text' for the text suite's experiment
  (configs/text_quickstart.py) or 'smollm2' for it on SmolLM2-135M (configs/text_smollm2.py),
  'tiny' for the seconds-long variant of either suite's quickstart."""
  words = set((arg or '').split(',')) - {''}
  unknown = words - {'text', 'smollm2', 'tiny'}
  if unknown or {'text', 'smollm2'} <= words or {'smollm2', 'tiny'} <= words:
    raise ValueError(f'config arguments {sorted(words)}: use "text" or "smollm2", and "tiny" '
                     'with "text" or alone')
  size = 'tiny' if 'tiny' in words else None
  if 'smollm2' in words:
    config = text_smollm2.get_config()
  else:
    config = (text_quickstart if 'text' in words else quickstart).get_config(size)

  # Which methods, λ's grid 0, lambda_step, ..., each method's lambda_max (merging/__init__.py:
  # 1, the authors' 3 for the SVD-era merges, 2 for TIES and Breadcrumbs), and the examples per
  # task that the data-driven methods read (Fisher, RegMean and RegMean++: labeled train;
  # AdaMerging: unlabeled test), at the defaults merging/jobs/merge.py declares; `lines`: the
  # methods also run with LiNeS' depth scaling (merging/lines.py), each as <method>+lines.
  config.merge = settings.defaults(merge_job.MERGE)
  config.merge.methods = ('averaging,task_arithmetic,ties,dare,breadcrumbs,consensus,magmax,'
                          'tsv_m,iso_c,iso_cts,wudi,model_stock,cart,fisher,regmean,'
                          'regmean_plusplus,adamerging_task,adamerging_layer,dam,tall_masks,emr,'
                          'dataless_localize_stitch,localize_stitch')

  if words & {'text', 'smollm2'}:
    # DAM perturbs pixels; tokens have no such space.
    config.merge.methods = config.merge.methods.replace(',dam,', ',')

  # Each method's settings, unset until given (its declared defaults fill them in where it
  # merges), and its grid axes.
  config.sweep = ml_collections.ConfigDict()
  for name, method in merging.REGISTRY.items():
    section = method.section or name
    if section not in config:
      config[section] = settings.unset(method.merge)
      config.sweep[section] = settings.sweep_axes(method.merge)
  config.adamerging_task.steps = config.adamerging_layer.steps = 200
  config.sweep.ties.density = (0.1, 0.2)
  config.sweep.dare.p = (0.3, 0.6)
  config.sweep.consensus.tall_lambda = (0.3, 0.5)
  # The TALL-mask paper's grid of λ_t, chosen per task on that task's validation split.
  config.sweep.tall_masks.tall_lambda = (0.2, 0.3, 0.4, 0.5, 0.6)

  if size == 'tiny':
    config.merge.update(lambda_step=0.5, train_examples=32)
    config.sweep.ties.density = (0.2,)
    config.sweep.dare.p = (0.5,)
    config.sweep.consensus.tall_lambda = (0.5,)
    config.sweep.tall_masks.tall_lambda = (0.2, 0.6)
    config.wudi.steps = 5
    config.adamerging_task.steps = 3
    config.adamerging_layer.steps = 3
    config.dam.update(steps=2, refit_steps=2)
    config.localize_stitch.epochs = 2
  return config
