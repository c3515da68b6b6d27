"""The shipped backbone: its bytes match the recorded hash, its record the default config, and it
loads into the default model, whose patch embedding is what numpy computes from its kernel and
whose features score the pretrained accuracy the suite documents; a damaged file or other
settings are refused before anything is written; the command that regenerates it runs at a tiny
scale."""

import filecmp
import hashlib
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
from tests import references
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
  with open(path, 'rb') as f:
    assert hashlib.sha256(f.read()).hexdigest() == _record()['sha256']
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


@pytest.fixture(scope='module', name='shipped')
def shipped_fixture():
  """(config, params, module, apply_fn) of the default config's shipped backbone."""
  config = quickstart_config.get_config()
  params, _ = checkpoint.load_tree(pretrain.shipped_backbone(config))
  module, apply_fn = experiment.model(config.model)
  return config, params, module, apply_fn


def test_the_patch_embedding_is_the_shipped_kernel_applied_to_standardised_patches(shipped):
  config, params, module, _ = shipped
  p = config.model.patch_size
  images = np.random.default_rng(1).uniform(size=(3, 32, 32, 3)).astype(np.float32)
  _, state = module.apply({'params': params}, images, capture_intermediates=True)
  tokens = np.asarray(state['intermediates']['patch_embed']['__call__'][0])
  # Non-overlapping p×p patches of (x − mean)/std, each contracted with the (p, p, 3, width)
  # kernel: a stride-p convolution without bias, written out.
  x = (images.astype(np.float64) - np.asarray(module.pixel_mean)) / np.asarray(module.pixel_std)
  patches = x.reshape(3, 32 // p, p, 32 // p, p, 3).transpose(0, 1, 3, 2, 4, 5)
  kernel = np.asarray(params['patch_embed']['kernel'], np.float64)
  assert kernel.shape == (p, p, 3, config.model.width)
  expected = np.einsum('bhwijc,ijcd->bhwd', patches, kernel)
  np.testing.assert_allclose(tokens, expected, rtol=1e-4, atol=1e-4)


def test_the_shipped_backbone_scores_its_documented_pretrained_accuracy(shipped):
  """docs/suite.md: letters 87.1% pretrained (suite seed 0), its head the centred, normalised
  class means of θ0's unit train embeddings; here recomputed with a numpy head and argmax.
  The smallest margin between a test image's two best cosines is 3.6e-4, far above float32
  noise, so the count is exact. A random or another backbone would not score it."""
  config, params, _, apply_fn = shipped
  task = experiment.load_task(config, 'letters')
  encode = jax.jit(apply_fn)

  def features(data):
    return np.concatenate([np.asarray(encode(params, data.batch(np.arange(s, min(s + 500, len(
        data))))[0])) for s in range(0, len(data), 500)])

  train = references.unit(features(task.train))
  means = np.stack([train[task.train.labels == c].mean(axis=0) for c in range(task.num_classes)])
  predicted = references.cosine_predictions(features(task.test), means - means.mean(axis=0))
  assert (predicted == task.test.labels).sum() == 871 and len(task.test) == 1000


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
