"""Which task vectors interfere: on a finished quickstart workdir (full fine-tuning), the test
accuracy of each task t under θ0 + α(τ_t + τ_s) for every other task s, beside θ0 + α·τ_t alone,
at the α task addition chose (0.55 on suite seed 0).

  python docs/experiments/pairwise_interference.py workdir/quickstart [alpha] [suite_seed]

Writes pairwise_interference.json beside this file and prints the table (rows: the task scored;
columns: the vector added to its own; the diagonal is its own vector alone).
"""

import json
import os
import sys

from configs import quickstart as quickstart_config
from editing.data import suite
from editing.jobs import experiment


def load(workdir: str, seed: int) -> experiment.Experiment:
  """The experiment of a quickstart workdir made at suite seed `seed`."""
  config = quickstart_config.get_config(None)
  config.suite.seed = seed
  return experiment.Experiment.load(config, workdir)


def save(out: dict, name: str) -> dict:
  """Writes `out` as `name`.json beside these scripts."""
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f'{name}.json'), 'w') as f:
    json.dump(out, f, indent=1)
  return out


def run(main) -> None:
  """main(workdir, [alpha], [suite_seed]) from the command line."""
  main(sys.argv[1], *(float(sys.argv[2]),) if len(sys.argv) > 2 else (),
       *(int(sys.argv[3]),) if len(sys.argv) > 3 else ())


def main(workdir: str, alpha: float = 0.55, seed: int = 0) -> dict:
  exp = load(workdir, seed)
  theta0, vectors, evaluator = exp.theta0, exp.vectors('full'), exp.evaluator('full')
  tasks = list(suite.DOWNSTREAM_TASKS)
  data, heads = exp.data(tasks), exp.heads(tasks)
  table = {}
  for t in tasks:
    table[t] = {}
    for s in tasks:
      params = evaluator.edit(theta0, vectors[t] if s == t else vectors[t] + vectors[s], alpha)
      table[t][s] = evaluator.accuracy(theta0, params, heads[t], data[t].test)
    print(f'{t:12}', ' '.join(f'{100 * table[t][s]:5.1f}' for s in tasks), flush=True)
  return save({'workdir': workdir, 'alpha': alpha, 'suite_seed': seed, 'test_accuracy': table},
              'pairwise_interference')


if __name__ == '__main__':
  run(main)
