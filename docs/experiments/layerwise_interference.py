"""Where in the network the other task vectors hurt a task under addition: on a finished
quickstart workdir (full fine-tuning), the test accuracy of task t under

  θ0 + α·(τ_t + Σ_{s≠t} τ_s restricted to one group of layers)   ("only <group>")
  θ0 + α·(τ_t + Σ_{s≠t} τ_s with one group of layers left out)    ("without <group>")

beside θ0 + α·τ_t alone and the whole sum, at the α task addition chose (0.55 on suite seed 0).
The groups (`groups`) are the embedding (patches, positions, class token, ln_pre), each block,
and the output (ln_post, proj). If the damage were additive over layers, the "only" rows would
add up to the whole loss; if one group carried it, leaving that group out would undo it.

  python docs/experiments/layerwise_interference.py workdir/quickstart [alpha] [suite_seed]

Writes layerwise_interference.json beside this file and prints the table.
"""

import jax.numpy as jnp

from editing import tree
from editing.data import suite
from pairwise_interference import load, run, save

TARGETS = ('count', 'digits', 'position')


def groups(params) -> dict[str, str]:
  """{group: regex over '/'-joined paths}: the embedding, each block of `params`, the output."""
  depth = len({path.split('/')[0] for path in tree.flatten(params) if path.startswith('blocks_')})
  return {'embedding': r'(patch_embed|position_embedding|class_embedding|ln_pre)(/.*)?',
          **{f'block {i}': rf'blocks_{i}/.*' for i in range(depth)},
          'output': r'(ln_post|proj)(/.*)?'}


def _restricted(vector, pattern, keep):
  """The vector with the leaves `pattern` matches kept (or zeroed, keep=False)."""
  inside = tree.select(vector.delta, [pattern])
  return vector.replace(delta=tree.map_with_path(
      lambda path, value: value if inside[path] == keep else jnp.zeros_like(value), vector.delta))


def main(workdir: str, alpha: float = 0.55, seed: int = 0) -> dict:
  exp = load(workdir, seed)
  theta0, vectors, evaluator = exp.theta0, exp.vectors('full'), exp.evaluator('full')
  table = {}
  for t in TARGETS:
    data, head = exp.task(t), exp.head(t)
    others = sum(vectors[s] for s in suite.DOWNSTREAM_TASKS if s != t)

    def accuracy(vector):
      return evaluator.accuracy(theta0, evaluator.edit(theta0, vector, alpha), head, data.test)

    row = {'alone': accuracy(vectors[t]), 'all': accuracy(vectors[t] + others)}
    for group, pattern in groups(theta0).items():
      row[f'only {group}'] = accuracy(vectors[t] + _restricted(others, pattern, keep=True))
      row[f'without {group}'] = accuracy(vectors[t] + _restricted(others, pattern, keep=False))
    table[t] = row
    print(f'{t:10}', '  '.join(f'{k} {100 * v:.1f}' for k, v in row.items()), flush=True)
  return save({'workdir': workdir, 'alpha': alpha, 'suite_seed': seed, 'test_accuracy': table},
              'layerwise_interference')


if __name__ == '__main__':
  run(main)
