"""The output lifecycle every checkpoint writer shares: real paths, partial directories that are
not ours, stale temporary files, a full disk, inputs edited in place, and passthrough's
record, resume and filters."""

import errno
import json
import os

import numpy as np
import pytest

from editing import safetensors_io
from editing.errors import UserError
from editing.models import hf
from merging import checkpoints
from merging.checkpoints import output as output_lib
from merging.checkpoints import passthrough
from tests import checkpoint_reference as reference
from tests.test_checkpoint_merging import fixture, output_bytes
from tests.test_reliability import TIES, interrupted


@pytest.fixture(scope='module', name='models')
def models_fixture(tmp_path_factory):
  """(base, fine-tunes) of the small 2-layer Llama-shaped fixture, made once: never changed."""
  return fixture(str(tmp_path_factory.mktemp('models')))


def test_a_base_given_through_a_symlink_is_not_overwritten(tmp_path):
  base, tuned = fixture(str(tmp_path / 'models'))
  os.symlink(base, tmp_path / 'link')
  before = output_bytes(base)
  with pytest.raises(UserError, match=r'overlaps the input .*link \(real paths'):
    checkpoints.merge(str(tmp_path / 'link'), tuned, base, TIES, overwrite=True)
  assert output_bytes(base) == before


def test_an_output_that_links_to_the_base_is_refused_in_one_line(tmp_path, models):
  base, tuned = models
  before = output_bytes(base)
  link = tmp_path / 'out'
  os.symlink(base, link)
  with pytest.raises(UserError, match=f'config.output = {link} overlaps the input') as e:
    checkpoints.merge(base, tuned, str(link), TIES, overwrite=True)
  assert '\n' not in str(e.value)
  assert sorted(os.listdir(tmp_path)) == ['out'] and output_bytes(base) == before


def test_an_output_that_links_elsewhere_is_written_where_it_points(tmp_path, models):
  base, tuned = models
  (tmp_path / 'old').mkdir()
  (tmp_path / 'old' / 'notes.txt').write_text('replaced')
  os.symlink(tmp_path / 'old', tmp_path / 'out')
  checkpoints.merge(base, tuned, str(tmp_path / 'out'), TIES, overwrite=True)
  checkpoints.merge(base, tuned, str(tmp_path / 'clean'), TIES)
  assert os.readlink(tmp_path / 'out') == str(tmp_path / 'old')
  assert output_bytes(str(tmp_path / 'old')) == output_bytes(str(tmp_path / 'clean'))
  assert sorted(f for f in os.listdir(tmp_path) if not f.endswith('.lock')) == [
      'clean', 'old', 'out']


def test_passthrough_over_or_inside_an_input_is_refused_and_deletes_nothing(tmp_path):
  out = tmp_path / 'out'
  base, _ = fixture(str(out / 'models'))  # the output directory holds the input
  before = output_bytes(base)
  with pytest.raises(UserError, match='overlaps the input'):
    passthrough.run([passthrough.Slice(base, 0, 2)], str(out), overwrite=True)
  assert output_bytes(base) == before
  inside = os.path.join(base, 'sub', 'merged')
  with pytest.raises(UserError, match='overlaps the input'):
    passthrough.run([passthrough.Slice(base, 0, 2)], inside)
  assert not os.path.exists(os.path.dirname(inside))


def test_a_partial_directory_that_is_not_a_jobs_is_refused_and_kept(tmp_path, models):
  base, tuned = models
  partial = tmp_path / 'out.partial'
  os.makedirs(partial / 'mine')  # a user's directory of that name, with something in it
  with pytest.raises(UserError, match=f'{partial} exists and has no readable merge_plan.json'):
    passthrough.run([passthrough.Slice(base, 0, 2)], str(tmp_path / 'out'))
  with pytest.raises(UserError, match='has no readable merge_plan.json'):
    checkpoints.merge(base, tuned, str(tmp_path / 'out'), TIES)
  assert os.listdir(partial) == ['mine'] and not os.path.exists(tmp_path / 'out')


def test_a_resume_drops_the_temporary_file_a_killed_write_left(tmp_path, models):
  base, tuned = models
  out = str(tmp_path / 'out')
  interrupted(base, tuned, out, TIES, after_blocks=8)
  stale = os.path.join(out + '.partial', '.tmp-k1ll3dmodel-00002-of-00012.safetensors')
  with open(stale, 'wb') as f:
    f.write(b'half a shard')
  checkpoints.merge(base, tuned, out, TIES)
  checkpoints.merge(base, tuned, str(tmp_path / 'clean'), TIES)
  assert output_bytes(out) == output_bytes(str(tmp_path / 'clean'))


def test_a_full_disk_names_the_output_in_one_line_and_the_rerun_resumes(tmp_path, models,
                                                                        monkeypatch):
  base, tuned = models
  out = str(tmp_path / 'out')
  fsync = os.fsync

  def full_at_the_third_shard(fd):
    if os.readlink(f'/proc/self/fd/{fd}').endswith('model-00003-of-00012.safetensors'):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    fsync(fd)

  monkeypatch.setattr(os, 'fsync', full_at_the_third_shard)
  with pytest.raises(UserError, match=rf'config.output = {out}: No space left on device while '
                                      rf'writing {out}.partial; free space') as e:
    checkpoints.merge(base, tuned, out, TIES)
  assert '\n' not in str(e.value)
  assert 'model-00002-of-00012.safetensors' in os.listdir(out + '.partial')
  monkeypatch.setattr(os, 'fsync', fsync)
  checkpoints.merge(base, tuned, out, TIES)
  checkpoints.merge(base, tuned, str(tmp_path / 'clean'), TIES)
  assert output_bytes(out) == output_bytes(str(tmp_path / 'clean'))


def edit_in_place(path: str, name: str) -> None:
  """Changes the first entry of the tensor `name` in the safetensors file `path`, keeping the
  file's size, header and modification time."""
  file = safetensors_io.File(path)
  offset = file.data_start + file.entries[name]['data_offsets'][0]
  stat = os.stat(path)
  first = file.tensor(name).reshape(-1)[:1]
  with open(path, 'r+b') as f:
    f.seek(offset)
    f.write((first + 1).tobytes())
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_resume_refuses_an_input_edited_in_place(tmp_path):
  base, tuned = fixture(str(tmp_path / 'models'))
  out = str(tmp_path / 'out')
  interrupted(base, tuned, out, TIES, after_blocks=8)
  assert 'model-00001-of-00012.safetensors' in os.listdir(out + '.partial')
  edited = os.path.join(tuned[1], hf.SINGLE)
  edit_in_place(edited, 'lm_head.weight')  # a tensor of the finished first shard
  with pytest.raises(UserError, match=f'{edited}: lm_head.weight has changed since {out}.partial'):
    checkpoints.merge(base, tuned, out, TIES)
  assert not os.path.exists(out) and os.path.exists(out + '.partial')


def test_a_killed_passthrough_resumes_to_the_same_bytes(tmp_path, models, monkeypatch):
  base, tuned = models
  slices = [passthrough.Slice(tuned[0], 1, 2), passthrough.Slice(base, 0, 2)]
  run = lambda out: passthrough.run(slices, out, shard_bytes=2500)
  read, calls = hf.Checkpoint.read, {'n': 0}

  def killed(*args, **kwargs):
    calls['n'] += 1
    if calls['n'] > 12:
      raise KeyboardInterrupt('killed')
    return read(*args, **kwargs)

  out = str(tmp_path / 'out')
  monkeypatch.setattr(hf.Checkpoint, 'read', killed)
  with pytest.raises(KeyboardInterrupt):
    run(out)
  monkeypatch.setattr(hf.Checkpoint, 'read', read)
  finished = {f: os.stat(os.path.join(out + '.partial', f)).st_ino
              for f in os.listdir(out + '.partial') if f.startswith('model-')}
  assert finished, 'no shard finished before the kill'
  run(out)
  run(str(tmp_path / 'clean'))
  assert output_bytes(out) == output_bytes(str(tmp_path / 'clean'))
  assert {f: os.stat(os.path.join(out, f)).st_ino for f in finished} == finished
  with open(os.path.join(out, output_lib.RECORD)) as f:
    assert json.load(f)['plan']['slices'] == [[tuned[0], 1, 2], [base, 0, 2]]


def test_a_passthrough_scale_filter_matches_the_input_tensors_name(tmp_path, models):
  """Layers 1 then 0 of the base, renumbered 0 and 1: the filter `layers.0.` picks the output's
  layer 1, which is the input's layer 0, as mergekit matches it."""
  base, _ = models
  scale = [{'filter': 'layers.0.', 'value': 0.0}, {'value': 1.0}]
  passthrough.run([passthrough.Slice(base, 1, 2), passthrough.Slice(base, 0, 1)],
                  str(tmp_path / 'out'), scale=scale)
  out, source = reference.read_output(str(tmp_path / 'out')), reference.read_output(base)
  name = 'model.layers.{}.self_attn.q_proj.weight'
  np.testing.assert_array_equal(out[name.format(0)], source[name.format(1)])
  np.testing.assert_array_equal(out[name.format(1)], np.zeros_like(source[name.format(0)]))
