"""The shipped backbone: its bytes match the recorded hash, its record the default config, and it
loads into the default model; a damaged file or other settings are refused before anything is
written; the command that regenerates it runs at a tiny scale."""

import filecmp
import json
import os
import shlex
import shutil

import jax
import numpy as np
import pytest

from configs import quickstart as quickstart_config
from editing import checkpoint
from editing import tree as tree_lib
from editing.errors import UserError
from editing.jobs import experiment
from editing.jobs import pretrain
from editing.jobs import workdir as workdir_lib
from tests.conftest import run_python

# A model small enough for the regenerating command to finish in seconds.
_TINY_OVERRIDES = ('--config.model.width=32', '--config.model.depth=1',
                   '--config.model.num_heads=2', '--config.model.mlp_dim=64',
                   '--config.model.embed_dim=32', '--config.pretrain.steps=4',
                   '--config.pretrain.batch_size=16', '--config.pretrain.warmup_steps=1',
                   '--config.pretrain.corpus_size=500')


def _record() -> dict:
  with open(pretrain.SHIPPED) as f:
    return json.load(f)


def test_the_default_config_uses_the_shipped_backbone_as_theta0(tmp_path):
  config = quickstart_config.get_config()
  path = pretrain.shipped_backbone(config)
  params, meta = checkpoint.load_tree(path)
  assert meta['model'] == config.model.to_dict() == _record()['model']
  module, apply_fn = experiment.model(config.model)
  images = np.random.default_rng(0).uniform(size=(4, 32, 32, 3)).astype(np.float32)
  expected = jax.eval_shape(module.init, jax.random.PRNGKey(0), images)['params']
  tree_lib.check_same_structure(expected, params, 'the default model', path)
  assert all(np.shape(params_leaf) == expected_leaf.shape for params_leaf, expected_leaf
             in zip(jax.tree.leaves(params), jax.tree.leaves(expected)))
  embeddings = np.asarray(apply_fn(params, images))
  assert embeddings.shape == (4, config.model.embed_dim) and np.isfinite(embeddings).all()
  assert np.ptp(embeddings, axis=0).max() > 0, 'every image gets the same embedding'

  workdir = str(tmp_path)
  pretrain.run(config, workdir)
  assert filecmp.cmp(path, workdir_lib.pretrained_file(workdir), shallow=False)


def test_other_settings_are_refused_naming_each_difference(tmp_path):
  config = quickstart_config.get_config()
  config.pretrain.steps = 600
  config.model.width = 64
  with pytest.raises(UserError, match=r'config.model.width = 64 \(shipped: 128\).*'
                                      r'config.pretrain.steps = 600 \(shipped: 30000\).*'
                                      r'from_scratch=true'):
    pretrain.run(config, str(tmp_path))
  assert not os.path.exists(workdir_lib.pretrained_file(str(tmp_path)))


def test_a_damaged_backbone_file_is_refused(tmp_path, monkeypatch):
  record = _record()
  shipped_dir = tmp_path / 'shipped'
  shipped_dir.mkdir()
  shutil.copy(pretrain.SHIPPED, shipped_dir)
  damaged = shipped_dir / record['file']
  data = bytearray(open(os.path.join(os.path.dirname(pretrain.SHIPPED), record['file']),
                        'rb').read())
  data[-1] ^= 1
  damaged.write_bytes(bytes(data))
  monkeypatch.setattr(pretrain, 'SHIPPED', str(shipped_dir / os.path.basename(pretrain.SHIPPED)))
  workdir = str(tmp_path / 'run')
  with pytest.raises(UserError, match=f'sha256 .*not the recorded {record["sha256"]}'):
    pretrain.run(quickstart_config.get_config(), workdir)
  assert not os.path.exists(workdir_lib.pretrained_file(workdir))


def test_the_regenerating_command_pretrains_at_a_tiny_scale(tmp_path):
  command = shlex.split(_record()['regenerate'])
  assert command[:3] == ['python', '-m', 'launch.pretrain']
  assert '--config.pretrain.from_scratch=true' in command
  flags = [f for f in command[3:] if not f.startswith('--workdir=')]
  workdir = str(tmp_path)
  run_python(['-m', 'launch.pretrain', *flags, *_TINY_OVERRIDES, f'--workdir={workdir}'])
  params, meta = checkpoint.load_tree(workdir_lib.pretrained_file(workdir))
  assert meta['model']['width'] == 32 and params['proj']['kernel'].shape == (32, 32)
  with open(os.path.join(workdir_lib.pretrain_dir(workdir), 'job_config.json')) as f:
    recorded = json.load(f)['pretrain']
  assert recorded['corpus'] == 'captions' and recorded['from_scratch'] is True
