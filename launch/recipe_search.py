r"""Each regime's fine-tuning recipe chosen on validation, then the protocols at it
(`editing.jobs.recipe_search`).

  python -m launch.recipe_search --workdir=workdir/recipes \
      --config.regimes=full,attention_only,linearized,talos,lora,l_lora
  python -m launch.recipe_search --config.sweep.finetune.learning_rate='(1e-4,1e-3)'

The grid is config.sweep.finetune of configs/recipe_search.py (the default config here).

Writes <workdir>/recipe_search/results.json (every point) and, at the chosen recipes, the
evaluation's results.json and report.md.
"""

from configs import recipe_search as recipe_search_config
from editing.jobs import cli
from editing.jobs import recipe_search

if __name__ == '__main__':
  cli.run(recipe_search.run, recipe_search_config)
