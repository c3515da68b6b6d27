"""The pretraining corpus: captions describe their scenes, the corpus is the same bytes however
it is generated, it never draws a downstream letter, and the captions backbone pretrains."""

import json

import numpy as np

from configs import quickstart as quickstart_config
from editing import checkpoint
from editing.data import captions
from editing.data import render
from editing.jobs import pretrain
from editing.jobs import workdir as workdir_lib


def test_pretraining_glyphs_are_not_the_letters_task():
  assert not set(render.PRETRAINING_GLYPHS) & set(render.GLYPHS)
  assert all(len(rows) == 7 and all(len(r) == 5 for r in rows)
             for rows in render.PRETRAINING_GLYPHS.values())
  assert not set(captions.VOCABULARY) & set(render.GLYPHS)


def test_captions_name_what_the_scene_holds():
  rng = np.random.default_rng(0)
  for _ in range(200):
    image, words = captions.scene(rng)
    assert image.shape == (32, 32, 3) and 0 <= image.min() and image.max() <= 1
    assert words <= set(captions.VOCABULARY)
    count = [w for w in words if w in captions.COUNTS]
    assert len(count) == 1 and len([w for w in words if w in captions.BACKGROUNDS]) == 1
    kinds = [w for w in words if w in captions.KINDS]
    # Distinct kinds can repeat, never outnumber the objects.
    assert 1 <= len(kinds) <= captions.COUNTS.index(count[0]) + 1
    assert words & set(captions.COLOURS) and words & set(captions.SIZES)
    assert bool(words & set(captions.BARS)) == ('bar' in words)


def test_the_corpus_is_the_same_bytes_in_one_process_or_several():
  alone = captions.load_corpus(seed=5, size=3 * captions.CHUNK + 10, processes=1)
  pooled = captions.load_corpus(seed=5, size=3 * captions.CHUNK + 10, processes=2)
  assert len(alone) == 3 * captions.CHUNK + 10
  np.testing.assert_array_equal(alone.images, pooled.images)
  np.testing.assert_array_equal(alone.labels, pooled.labels)
  other = captions.chunk(6, 0)[0]
  assert not np.array_equal(other, alone.images[:captions.CHUNK])
  assert alone.labels.shape == (len(alone), len(captions.VOCABULARY))
  assert (alone.labels.sum(axis=0) > 0).all(), 'a word no caption uses'


def test_captions_pretraining_learns_and_serves_every_suite_seed(tmp_path):
  config = quickstart_config.get_config('tiny')
  config.pretrain.update(corpus='captions', steps=30)
  workdir = str(tmp_path)
  pretrain.run(config, workdir)
  params, meta = checkpoint.load_tree(workdir_lib.pretrained_file(workdir))
  assert meta['model'] == config.model.to_dict()
  with open(workdir_lib.pretrain_dir(workdir) + '/metrics.jsonl') as f:
    losses = [json.loads(line)['loss'] for line in f]
  assert losses[-1] < losses[0]
  # The corpus does not depend on the suite's seed: the backbone is reused under another.
  config.suite.seed = 1
  before = np.asarray(params['proj']['kernel'])
  pretrain.run(config, workdir)
  after = checkpoint.load_tree(workdir_lib.pretrained_file(workdir))[0]['proj']['kernel']
  np.testing.assert_array_equal(before, after)
