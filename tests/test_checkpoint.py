"""safetensors I/O: round trips, metadata, and no partial file after a failed write."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from editing import atomic
from editing import checkpoint
from editing.task_vector import TaskVector


def test_tree_round_trip_keeps_paths_dtypes_and_metadata(tmp_path):
  tree = {'a': {'kernel': np.arange(6, dtype=np.float32).reshape(2, 3)},
          'b': np.array([1, 2], np.int32), 'c': jnp.ones((2,), jnp.bfloat16)}
  path = str(tmp_path / 'x.safetensors')
  checkpoint.save_tree(path, tree, {'model': {'width': 3}})
  loaded, meta = checkpoint.load_tree(path)
  assert meta == {'model': {'width': 3}}
  np.testing.assert_array_equal(loaded['a']['kernel'], tree['a']['kernel'])
  assert loaded['b'].dtype == np.int32 and loaded['c'].dtype == jnp.bfloat16


def test_task_vector_round_trip(tmp_path):
  vector = TaskVector({'w': jnp.arange(3.0)}, ('digits', 'size'), 'full', 'abc123')
  path = str(tmp_path / 'tv.safetensors')
  checkpoint.save_task_vector(path, vector)
  loaded, _ = checkpoint.load_task_vector(path)
  assert (loaded.tasks, loaded.regime, loaded.base) == (vector.tasks, 'full', 'abc123')
  np.testing.assert_array_equal(loaded.delta['w'], vector.delta['w'])


def test_plain_params_file_is_not_taken_for_a_task_vector(tmp_path):
  path = str(tmp_path / 'p.safetensors')
  checkpoint.save_tree(path, {'w': np.zeros(2, np.float32)})
  with pytest.raises(ValueError, match='not a task vector file'):
    checkpoint.load_task_vector(path)


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
  path = str(tmp_path / 'y.safetensors')
  with pytest.raises(TypeError):
    checkpoint.save_tree(path, {'w': np.zeros(2, np.float32)}, {'bad': object()})
  atomic.write_bytes(path, b'old')

  def failing_replace(*args):
    raise OSError('disk full')

  monkeypatch.setattr(os, 'replace', failing_replace)
  with pytest.raises(OSError):
    atomic.write_bytes(path, b'new')
  monkeypatch.undo()
  assert open(path, 'rb').read() == b'old'
  assert os.listdir(tmp_path) == ['y.safetensors']


def test_missing_file_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match='nothing.safetensors'):
    checkpoint.load_tree(str(tmp_path / 'nothing.safetensors'))


def test_written_files_get_the_usual_permissions(tmp_path):
  path = tmp_path / 'report.md'
  atomic.write_bytes(str(path), b'x')
  mask = os.umask(0)
  os.umask(mask)
  assert path.stat().st_mode & 0o777 == 0o666 & ~mask
