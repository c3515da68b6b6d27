"""Continual merging (merging/continual.py): OPCM against a float64 numpy port of its authors'
rule, its defining properties (the merge keeps the mean norm of the vectors seen; an arriving
weight enters outside the merge's top singular block), the running baselines against their
batch forms, and the protocol run from launch.merge on the tiny suite."""

import json
import os

import numpy as np
import pytest

from configs import merge as merge_config
from editing.errors import UserError
from editing.jobs import workdir as workdir_lib
from editing.task_vector import TaskVector
from merging import continual
from merging import magmax
from merging import ties
from merging.jobs import merge

RNG = np.random.default_rng(0)


def _vectors(count=4):
  """Vectors with a linear kernel (6 × 5), an attention output kernel (2, 3, 4) and a bias."""
  return [TaskVector({'dense': {'kernel': RNG.standard_normal((6, 5)).astype(np.float32),
                                'bias': RNG.standard_normal(5).astype(np.float32)},
                      'attn': {'out': {'kernel': RNG.standard_normal((2, 3, 4)).astype(
                          np.float32)}}}, (f't{i}',), 'full', 'base') for i in range(count)]


def _flat(vector):
  d = vector.delta
  return {'k': np.asarray(d['dense']['kernel'], np.float64),
          'b': np.asarray(d['dense']['bias'], np.float64),
          'o': np.asarray(d['attn']['out']['kernel'], np.float64).reshape(6, 4)}


def _opcm_numpy(vectors, alpha):
  """The authors' loop: merged Δ, λ, mean norm; the linear weights projected."""
  taus = [_flat(v) for v in vectors]
  norm = lambda tree: np.sqrt(sum(np.sum(x**2) for x in tree.values()))
  merged, lam, norms, out = taus[0], 1.0, [norm(taus[0])], [taus[0]]
  for tau in taus[1:]:
    summed = {}
    for key, kept in merged.items():
      new = tau[key]
      if key in ('k', 'o'):
        u, s, vt = np.linalg.svd(kept, full_matrices=True)
        split = int(np.argmax(np.cumsum(s) / s.sum() > alpha))
        p = u.T @ new @ vt.T
        np.fill_diagonal(p, 0)
        p[:split, :split] = 0
        new = u @ p @ vt
      summed[key] = lam * kept + new
    norms.append(norm(tau))
    lam = norm(summed) / np.mean(norms)
    merged = {k: x / lam for k, x in summed.items()}
    out.append(merged)
  return out


def test_opcm_equals_the_authors_rule():
  vectors = _vectors()
  ours = continual.run('opcm', vectors, {'alpha': 0.5})
  for step, (got, expected) in enumerate(zip(ours, _opcm_numpy(vectors, 0.5))):
    for key, value in _flat(got).items():
      np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-5,
                                 err_msg=f'step {step} {key}')


def test_opcm_keeps_the_mean_norm_and_projects_out_the_merges_top_block():
  vectors = _vectors()
  steps = continual.run('opcm', vectors, {'alpha': 0.5})
  norms = [np.sqrt(sum(np.sum(x**2) for x in _flat(v).values())) for v in vectors]
  for t, merged in enumerate(steps):
    total = np.sqrt(sum(np.sum(x**2) for x in _flat(merged).values()))
    assert total == pytest.approx(np.mean(norms[:t + 1]), rel=1e-5)
  kept = _flat(steps[0])['k']
  projected = continual.project_out(kept, _flat(vectors[1])['k'], 0.5)
  u, s, vt = np.linalg.svd(kept, full_matrices=True)
  split = int(np.argmax(np.cumsum(s) / s.sum() > 0.5))
  inside = u.T @ np.asarray(projected) @ vt.T
  assert split >= 1
  np.testing.assert_allclose(inside[:split, :split], 0, atol=1e-5)
  np.testing.assert_allclose(np.diag(inside), 0, atol=1e-5)


def test_running_baselines_equal_their_batch_forms():
  vectors = _vectors()
  arithmetic = continual.run('task_arithmetic', vectors, {'scale': 0.3})[-1]
  average = continual.run('weight_average', vectors, {})[-1]
  running_max = continual.run('magmax', vectors, {'scale': 0.5})[-1]
  for key in ('k', 'b', 'o'):
    stacked = np.stack([_flat(v)[key] for v in vectors])
    np.testing.assert_allclose(_flat(arithmetic)[key], 0.3 * stacked.sum(0), rtol=1e-5)
    np.testing.assert_allclose(_flat(average)[key], stacked.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_flat(running_max)[key], 0.5 * _flat(magmax.merge(vectors))[key],
                               rtol=1e-6)
  # TIES keeps the pairwise merge of what it kept and what arrives.
  two = continual.run('ties', vectors[:2], {'density': 0.2, 'scale': 0.5})[-1]
  pair = ties.merge(vectors[:2], density=0.2, scope='global', normalize=True)
  for key in ('k', 'b', 'o'):
    np.testing.assert_allclose(_flat(two)[key], 0.5 * _flat(pair)[key], rtol=1e-6)


def test_the_protocol_runs_from_launch_merge(tiny_run):
  _, workdir, _ = tiny_run
  config = merge_config.get_config('tiny')
  config.regimes, config.merge.methods = 'full', ''
  config.merge.continual, config.merge.orders = 'task_arithmetic,opcm', 2
  summary = merge.run(config, workdir)['full']['continual']
  directory = workdir_lib.merge_dir(workdir, 'full')
  with open(os.path.join(directory, 'continual.json')) as f:
    assert json.load(f)['methods'].keys() == {'task_arithmetic', 'opcm'}
  tasks = summary['tasks']
  for result in summary['methods'].values():
    first, second = [r['order'] for r in result['runs']]
    assert first == tasks and sorted(second) == sorted(tasks)
    for run in result['runs']:
      assert len(run['curve']) == len(tasks) and set(run['final']) == set(tasks)
      assert run['curve'][-1] == pytest.approx(np.mean(list(run['final'].values())))
  # The second orders of the methods are the same draw.
  orders = [r['runs'][1]['order'] for r in summary['methods'].values()]
  assert orders[0] == orders[1]
  assert os.path.exists(os.path.join(directory, 'continual.png'))
  config.merge.continual = 'nope'
  with pytest.raises(UserError, match=r"config.merge.continual: \['nope'\]"):
    merge.run(config, workdir)
