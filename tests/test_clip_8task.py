"""The 8-task pipeline on local data, end to end: tiny random CLIP weights and tiny datasets the
test writes as class folders and parquet exports; zero-shot heads → fine-tuning in every
regime → task vectors → evaluation → merges → a Hugging Face export transformers loads."""

import copy
import io
import json
import math
import os

import numpy as np
import orbax.checkpoint as ocp
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers
from PIL import Image

from configs import clip_8task
from editing import checkpoint
from editing.data import suite
from editing.data import triggers
from editing import tree as tree_lib
from editing.errors import UserError
from editing.jobs import experiment
from editing.jobs import pretrain
from editing.jobs import quickstart
from editing.jobs import workdir as workdir_lib
from editing.models import hf
from editing.models import text
from editing.models import zero_shot
from merging.jobs import export
from merging.jobs import merge
from merging.jobs import safety
from tests.test_hf import clip_model, images, ours, theirs, unit
from tests.test_zero_shot import save_tokenizer

# Folder datasets number their classes in sorted order; parquet ones as their ClassLabel.
CLASSES = {'alpha': ['blue_square', 'green_square', 'red_square'],
           'beta': ['dark', 'bright'],
           'gamma': ['cool', 'warm']}
TEMPLATES = ('a photo of a {}.', 'a {} thing.')


def picture(rng, label, classes):
  """A 40x48 image whose colour is its class, under noise: learnable, and resized and cropped
  to 32 px by CLIP's preprocessing."""
  colour = np.zeros(3)
  colour[label % 3] = 0.4 + 0.5 * label / max(1, len(classes) - 1)
  pixels = np.clip(colour + 0.2 * rng.standard_normal((40, 48, 3)), 0, 1)
  return Image.fromarray(np.round(255 * pixels).astype(np.uint8))


def write_folders(root, classes, splits):
  rng = np.random.default_rng(len(classes))
  for split, count in splits.items():
    for i in range(count):
      label = i % len(classes)
      directory = os.path.join(root, split, classes[label])
      os.makedirs(directory, exist_ok=True)
      picture(rng, label, classes).save(os.path.join(directory, f'{i}.png'))


def write_parquet(root, classes, splits):
  """Parquet exports as the `datasets` library writes them, ClassLabel names in the schema."""
  rng = np.random.default_rng(7)
  os.makedirs(root)
  features = {'image': {'_type': 'Image'}, 'label': {'names': classes, '_type': 'ClassLabel'}}
  for split, count in splits.items():
    rows, labels = [], []
    for i in range(count):
      buffer = io.BytesIO()
      picture(rng, i % len(classes), classes).save(buffer, format='PNG')
      rows.append({'bytes': buffer.getvalue(), 'path': None})
      labels.append(i % len(classes))
    table = pa.table({'image': rows, 'label': pa.array(labels, pa.int64())})
    table = table.replace_schema_metadata(
        {b'huggingface': json.dumps({'info': {'features': features}})})
    pq.write_table(table, os.path.join(root, f'{split}.parquet'), row_group_size=8)


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp('clip_8task')
  weights = str(root / 'clip')
  clip_model().save_pretrained(weights)
  prompts = [t.format(c.replace('_', ' ')) for names in CLASSES.values() for c in names
             for t in TEMPLATES]
  save_tokenizer(root / 'clip', prompts)
  data_root = str(root / 'data')
  write_folders(os.path.join(data_root, 'alpha'), CLASSES['alpha'], {'train': 30, 'test': 12})
  write_parquet(os.path.join(data_root, 'beta'), CLASSES['beta'], {'train': 20, 'test': 10})
  write_folders(os.path.join(data_root, 'gamma'), CLASSES['gamma'],
                {'train': 10, 'val': 6, 'test': 8})
  config = clip_8task.get_config('tiny')
  config.weights, config.data_root = weights, data_root
  config.data.update(tasks='alpha,beta', control='gamma', templates=TEMPLATES, val_fraction=0.3)
  config.data.epochs = {'alpha': 1}
  config.regimes = 'full,attention_only,linearized,talos'
  config.merge.methods = 'task_arithmetic,ties'
  return config, str(root / 'work')


def test_zero_shot_heads_fine_tuning_in_every_regime_and_evaluation(setup):
  config, workdir = setup
  results = quickstart.run(config, workdir)
  assert set(results['regimes']) == {'full', 'attention_only', 'linearized', 'talos'}
  assert results['control_task'] == 'gamma'
  for regime in results['regimes'].values():
    assert set(regime['finetuned']) >= {'alpha', 'beta'}
    assert 0 <= regime['addition']['mean_test'] <= 1
  # θ0 is the checkpoint's image tower, each head zero-shot from its text tower.
  theta0, _ = experiment.load_pretrained(workdir)
  imported, _ = hf.load(config.weights, 'clip_vision')
  np.testing.assert_array_equal(theta0['proj']['kernel'], imported['proj']['kernel'])
  text_params, text_model = hf.load(config.weights, 'clip_text')
  for task, names in CLASSES.items():
    stored = checkpoint.load_tree(workdir_lib.head_file(workdir, task))[0]['head']
    expected = zero_shot.head(text_params, text_model, text.Tokenizer(config.weights),
                              [n.replace('_', ' ') for n in names], TEMPLATES)
    np.testing.assert_allclose(stored, expected, atol=1e-6)
  # alpha trains for its one epoch (30 images less the 30% held out, batch 8); beta for
  # config.finetune.steps.
  for task, steps in (('alpha', math.ceil(21 / 8)), ('beta', config.finetune.steps)):
    with open(os.path.join(workdir_lib.finetune_dir(workdir, 'full', task),
                           'metrics.jsonl')) as f:
      assert [json.loads(line) for line in f][-1]['step'] == steps


def test_merges_export_to_a_model_transformers_loads(setup, tmp_path):
  config, workdir = setup
  merged = merge.run(config, workdir)
  assert set(merged['full']['methods']) >= {'task_arithmetic', 'ties'}
  config.export.update(method='ties', output=str(tmp_path / 'merged'))
  directory = export.run(config, workdir)
  params, model = hf.load(directory, 'clip_vision')
  reloaded = transformers.CLIPVisionModelWithProjection.from_pretrained(directory).eval()
  _, embeds = ours(params, model, images())
  _, their_embeds = theirs(reloaded, images())
  assert np.abs(unit(embeds) - unit(their_embeds)).max() < 1e-5
  # The export holds the very params the merge chose, bit for bit.
  with ocp.StandardCheckpointer() as checkpointer:
    chosen = checkpointer.restore(os.path.join(workdir_lib.merge_dir(workdir, 'full'), 'ties',
                                               'params'))
  exported = tree_lib.flatten(params)
  for path, leaf in tree_lib.flatten(chosen).items():
    np.testing.assert_array_equal(exported[path], np.asarray(leaf))


def test_the_backdoor_experiment_runs_on_images_on_disk(setup, tmp_path):
  config, _ = setup
  config = copy.deepcopy(config)
  config.regimes = 'full'
  config.safety.victims = 'alpha'
  summary = safety.run(config, str(tmp_path))
  merges = {m['method']: m for m in summary['merges']}
  assert set(merges) == {'task_arithmetic', 'dam'}
  for m in merges.values():
    assert 0 <= m['succession'] <= 1 and 0 <= m['mean_test'] <= 1
  assert set(summary['fine_tunes'][0]) == {'clean/alpha', 'clean/beta', 'badnets/alpha'}


def test_images_on_disk_carry_a_trigger_as_the_suites_do(setup):
  config, _ = setup
  test = experiment.load_task(config, 'alpha').test
  trigger = triggers.BadNets()
  clean, labels = test.batch(np.arange(len(test)))
  in_memory = suite.Dataset(np.round(clean * 255).astype(np.uint8), labels)
  poisoned = triggers.poison(test, trigger, rate=0.5, target=1, seed=3)
  expected = triggers.poison(in_memory, trigger, rate=0.5, target=1, seed=3)
  images, poisoned_labels = poisoned.batch(np.arange(len(test)))
  expected_images, expected_labels = expected.batch(np.arange(len(test)))
  np.testing.assert_allclose(images, expected_images, atol=1e-6)
  np.testing.assert_array_equal(poisoned_labels, expected_labels)
  changed = (images != clean).any(axis=(1, 2, 3))
  assert 0 < changed.sum() <= len(test) // 2 + 1
  # A subset keeps each example's trigger; the clean dataset is untouched.
  rows = np.flatnonzero(changed)[:2]
  np.testing.assert_array_equal(poisoned.subset(rows).batch([0, 1])[0], images[rows])
  np.testing.assert_array_equal(test.batch(np.arange(len(test)))[0], clean)


def test_weights_of_another_architecture_are_refused(setup, tmp_path):
  config, _ = setup
  other = clip_8task.get_config('vit_b32')
  other.weights, other.data_root = config.weights, config.data_root
  with pytest.raises(UserError, match=r'config.model.patch_size = 32 \(checkpoint: 8\)'):
    pretrain.run(other, str(tmp_path))
  assert not os.path.exists(workdir_lib.pretrained_file(str(tmp_path)))
