r"""Each regime's fine-tuning recipe chosen on validation, then the protocols at it.

  python -m launch.recipe_search --config=configs/recipe_search.py --workdir=workdir/recipes \
      --config.regimes=full,attention_only,linearized,talos,lora,l_lora
  python -m launch.recipe_search --config=configs/recipe_search.py \
      --config.sweep.finetune.learning_rate='(1e-4,1e-3)'
  python -m launch.recipe_search --config=configs/recipe_search.py:tiny --workdir=/tmp/recipes

Derived from configs/quickstart.py (the same backbone, suite and evaluation). The grid is a
sweep written apart from the values (editing/sweep.py): every regime is fine-tuned on every task
at each learning_rate × steps of config.sweep.finetune, at the first seed of its `seed` axis;
the point of best mean validation accuracy is the regime's recipe, and the protocols run at it
once per seed of that axis (mean ± std over them). config.finetune's learning_rate, steps and
seed are unset, since the sweep gives them: a setting is given a value or an axis, not both
(a value alone is a grid of one).
"""

import ml_collections

from configs import quickstart


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = quickstart.get_config(arg)
  for name, kind in (('learning_rate', float), ('steps', int), ('seed', int)):
    del config.finetune[name]
    config.finetune[name] = ml_collections.config_dict.placeholder(kind)

  config.sweep = ml_collections.ConfigDict()
  config.sweep.finetune = ml_collections.ConfigDict(dict(
      learning_rate=(3e-5, 1e-4, 3e-4, 1e-3), steps=(100, 300), seed=(0, 1, 2)))

  # `records`, a directory, gathers regimes searched in separate workdirs: a run first restores
  # each <regime>.json there that its workdir lacks, and at its end saves every regime it
  # tabulates there (docs/recipe_search holds ours).
  # `select`: the criterion that makes a regime's recipe, 'single_task' (the mean single-task
  # validation accuracy, the papers') or 'addition' (task addition's normalized validation
  # accuracy); both choices are recorded and tabulated.
  config.recipe_search = ml_collections.ConfigDict(dict(records='', select='single_task'))

  if arg == 'tiny':
    config.sweep.finetune.update(learning_rate=(1e-3, 3e-3), steps=(6, 12), seed=(0,))
  return config
