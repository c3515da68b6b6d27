"""The merges that keep a vector per task, each applied to its own task's inputs: EMR-Merging
and TALL masks against numpy ports of their authors' formulas, their defining properties, and
the merge job choosing each task's setting on that task's own validation split."""

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import merge as merge_config
from editing import checkpoint
from editing.errors import UserError
from editing.jobs import experiment
from editing.jobs import workdir as workdir_lib
from editing.task_vector import TaskVector
from merging import emr
from merging import tall_masks
from merging.jobs import export
from merging.jobs import merge


def vectors(count: int, seed: int = 0) -> list[TaskVector]:
  rng = np.random.default_rng(seed)
  return [TaskVector({'a': {'kernel': jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)},
                      'b': jnp.asarray(rng.normal(size=(5,)), jnp.float32)},
                     (f't{k}',), 'full', 'base')
          for k in range(count)]


def numpy_emr(deltas: list[dict]) -> list[dict]:
  """The authors' emr_merge on flat {path: array}: elect, masks, per-tensor-mean rescalers."""
  paths = list(deltas[0])
  sign = {p: np.where(sum(d[p] for d in deltas) > 0, 1.0, -1.0) for p in paths}
  unified = {p: sign[p] * np.max([np.abs(d[p]) * (d[p] * sign[p] > 0) for d in deltas], axis=0)
             for p in paths}
  out = []
  for d in deltas:
    masked = {p: unified[p] * (d[p] * sign[p] > 0) for p in paths}
    rescale = (sum(np.abs(d[p]).mean() for p in paths) /
               sum(np.abs(masked[p]).mean() for p in paths))
    out.append({p: rescale * masked[p] for p in paths})
  return out


def flat(vector: TaskVector) -> dict:
  return {'/'.join(str(k.key) for k in path): np.asarray(x)
          for path, x in jax.tree_util.tree_flatten_with_path(vector.delta)[0]}


def test_emr_matches_its_authors_formulas():
  given = vectors(3)
  expected = numpy_emr([flat(v) for v in given])
  for got, want in zip(emr.merge(given), expected):
    for path, value in flat(got).items():
      np.testing.assert_allclose(value, want[path], rtol=1e-6, err_msg=path)


def test_emr_gives_each_task_its_signs_and_its_mean_magnitude_and_one_task_itself():
  given = vectors(4, seed=1)
  for vector, own in zip(emr.merge(given), given):
    ours, theirs = flat(vector), flat(own)
    for path in ours:  # where kept, the entry has the task's own sign
      kept = ours[path] != 0
      assert (np.sign(ours[path][kept]) == np.sign(theirs[path][kept])).all()
    assert sum(np.abs(x).mean() for x in ours.values()) == pytest.approx(
        sum(np.abs(x).mean() for x in theirs.values()), rel=1e-5)
  alone = given[0]
  for path, value in flat(emr.merge([alone])[0]).items():
    np.testing.assert_allclose(value, flat(alone)[path], rtol=1e-6)


def test_tall_masks_keep_the_entries_where_a_task_outweighs_the_others():
  given = vectors(3, seed=2)
  deltas = [flat(v) for v in given]
  for lam in (0.0, 0.4):
    for t, got in enumerate(tall_masks.merge(given, tall_lambda=lam)):
      for path, value in flat(got).items():
        total = sum(d[path] for d in deltas)
        mask = np.abs(deltas[t][path]) >= lam * np.abs(total - deltas[t][path])
        np.testing.assert_allclose(value, np.where(mask, total, 0), rtol=1e-6, err_msg=path)
  # λ = 0 keeps everything: each task gets the whole sum.
  for got in tall_masks.merge(given, tall_lambda=0.0):
    for path, value in flat(got).items():
      np.testing.assert_allclose(value, sum(d[path] for d in deltas), rtol=1e-6)


def test_the_merge_job_chooses_each_tasks_setting_on_its_own_validation(tiny_run, tmp_path):
  _, workdir, _ = tiny_run
  config = merge_config.get_config('tiny')
  config.merge.methods = 'tall_masks,emr'
  summary = merge.run(config, workdir)['full']
  tasks = experiment.tasks(config)
  theta0, apply_fn = experiment.load_pretrained(workdir)
  evaluator = experiment.evaluator(config, apply_fn, 'full')
  given = [checkpoint.load_task_vector(workdir_lib.task_vector_file(workdir, 'full', t))[0]
           for t in tasks]
  data = {t: experiment.load_task(config, t) for t in tasks}
  heads = {t: experiment.head(config, workdir, data[t], theta0, apply_fn) for t in tasks}
  accuracy = lambda vector, t, split: evaluator.accuracy(
      theta0, evaluator.edit(theta0, vector, 1.0), heads[t], getattr(data[t], split))
  grid = config.sweep.tall_masks.tall_lambda
  per_lambda = {lam: tall_masks.merge(given, tall_lambda=lam) for lam in grid}
  result = summary['methods']['tall_masks']
  for k, t in enumerate(tasks):
    scores = [accuracy(per_lambda[lam][k], t, 'val') for lam in grid]
    chosen = grid[scores.index(max(scores))]  # ties to the first, as the job keeps the first
    assert result['hyperparameters'][t] == {'tall_lambda': chosen}, (t, scores)
    assert result['test'][t] == accuracy(per_lambda[chosen][k], t, 'test')
  for t, vector in zip(tasks, emr.merge(given)):
    assert summary['methods']['emr']['test'][t] == accuracy(vector, t, 'test')
  with open(os.path.join(workdir_lib.merge_dir(workdir, 'full'), 'report.md')) as f:
    assert 'tall_lambda=' + '/'.join(str(result['hyperparameters'][t]['tall_lambda'])
                                     for t in tasks) in f.read()
  config.export = ml_collections.ConfigDict(dict(regime='full', method='emr', task='',
                                                 output=str(tmp_path / 'out'),
                                                 shard_bytes=1 << 30))
  with pytest.raises(UserError, match='config.export.method = emr keeps a model per task'):
    export.run(config, workdir)
  assert not os.path.exists(tmp_path / 'out')
