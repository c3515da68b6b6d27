r"""Each regime's fine-tuning recipe chosen on validation, then the protocols at it
(`editing.jobs.recipe_search`).

  python -m launch.recipe_search --workdir=workdir/recipes \
      --config.regimes=full,attention_only,linearized,talos,lora,l_lora
  python -m launch.recipe_search --config.recipe_search.learning_rate='(1e-4,1e-3)'

Writes <workdir>/recipe_search/results.json (every point) and, at the chosen recipes, the
evaluation's results.json and report.md.
"""

from configs import quickstart as quickstart_config
from editing.jobs import cli
from editing.jobs import recipe_search

if __name__ == '__main__':
  cli.run(recipe_search.run, quickstart_config)
