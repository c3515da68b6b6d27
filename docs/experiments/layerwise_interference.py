"""Where in the network the other task vectors hurt a task under addition: on a finished
quickstart workdir (full fine-tuning), the test accuracy of task t under

  θ0 + α·(τ_t + Σ_{s≠t} τ_s restricted to one group of layers)   ("only <group>")
  θ0 + α·(τ_t + Σ_{s≠t} τ_s with one group of layers left out)    ("without <group>")

beside θ0 + α·τ_t alone and the whole sum, at the α task addition chose (0.55 on suite seed 0).
The groups are the embedding (patches, positions, class token, ln_pre), each block, and the
output (ln_post, proj). If the damage were additive over layers, the "only" rows would add up to
the whole loss; if one group carried it, leaving that group out would undo it.

  python docs/experiments/layerwise_interference.py workdir/quickstart [alpha] [suite_seed]

Writes layerwise_interference.json beside this file and prints the table.
"""

import jax
import jax.numpy as jnp

from editing.data import suite
from editing.jobs import experiment
from pairwise_interference import load, run, save

GROUPS = {
    'embedding': ('patch_embed', 'position_embedding', 'class_embedding', 'ln_pre'),
    **{f'block {i}': (f'blocks_{i}',) for i in range(4)},
    'output': ('ln_post', 'proj'),
}
TARGETS = ('count', 'digits', 'position')


def _restricted(vector, names, keep):
  """The vector with the leaves under the top-level modules `names` kept (or zeroed, keep=False)."""
  def leaf(path, value):
    return value if (path[0].key in names) == keep else jnp.zeros_like(value)
  return vector.replace(delta=jax.tree_util.tree_map_with_path(leaf, vector.delta))


def main(workdir: str, alpha: float = 0.55, seed: int = 0) -> dict:
  config, theta0, apply_fn, vectors, evaluator = load(workdir, seed)
  table = {}
  for t in TARGETS:
    data = experiment.load_task(config, t)
    head = experiment.head(config, workdir, data, theta0, apply_fn)
    others = sum(vectors[s] for s in suite.DOWNSTREAM_TASKS if s != t)

    def accuracy(vector):
      return evaluator.accuracy(theta0, evaluator.edit(theta0, vector, alpha), head, data.test)

    row = {'alone': accuracy(vectors[t]), 'all': accuracy(vectors[t] + others)}
    for group, names in GROUPS.items():
      row[f'only {group}'] = accuracy(vectors[t] + _restricted(others, names, keep=True))
      row[f'without {group}'] = accuracy(vectors[t] + _restricted(others, names, keep=False))
    table[t] = row
    print(f'{t:10}', '  '.join(f'{k} {100 * v:.1f}' for k, v in row.items()), flush=True)
  return save({'workdir': workdir, 'alpha': alpha, 'suite_seed': seed, 'test_accuracy': table},
              'layerwise_interference')


if __name__ == '__main__':
  run(main)
