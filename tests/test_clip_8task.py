"""The 8-task pipeline on local data, end to end: tiny random CLIP weights and tiny datasets the
test writes as class folders and parquet exports; zero-shot heads → fine-tuning in every
regime → task vectors → evaluation → merges → a Hugging Face export transformers loads."""

import copy
import io
import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
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
from tests import references
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
  # A nonlinear and a linear regime: the others differ from full only in which leaves train,
  # which the image quickstart's tests cover.
  config.regimes = 'full,linearized'
  config.merge.methods = 'task_arithmetic,ties'
  return config, str(root / 'work')


@pytest.fixture(scope='module')
def finished(setup):
  """(config, workdir, results) of the pipeline run once on the data on disk, for every test
  that reads its workdir (they copy the config before changing it)."""
  config, workdir = setup
  return config, workdir, quickstart.run(copy.deepcopy(config), workdir)


def embeddings(regime, apply_fn, theta0, params, images):
  """f(x; θ), or for linear task vectors f_lin(x; θ) = f(x; θ0) + J(θ0)(θ − θ0)."""
  if regime != 'linearized':
    return np.asarray(apply_fn(params, images))
  tangent = jax.tree.map(jnp.subtract, params, theta0)
  out, dout = jax.jvp(lambda p: apply_fn(p, images), (theta0,), (tangent,))
  return np.asarray(out + dout)


def test_zero_shot_heads_fine_tuning_and_evaluation_of_nonlinear_and_linear_vectors(finished):
  config, workdir, results = finished
  assert set(results['regimes']) == {'full', 'linearized'}
  assert results['control_task'] == 'gamma'
  theta0, apply_fn = experiment.load_pretrained(workdir)
  heads = {t: checkpoint.load_tree(workdir_lib.head_file(workdir, t))[0]['head'] for t in CLASSES}
  tests = {t: experiment.load_task(config, t).test for t in ('alpha', 'beta')}
  tests = {t: test.batch(np.arange(len(test))) for t, test in tests.items()}
  for name, regime in results['regimes'].items():
    assert set(regime['finetuned']) >= {'alpha', 'beta'}
    # Addition's test accuracies are the share of test images whose cosine-head argmax (numpy)
    # is their label, on θ0 + α(τ_alpha + τ_beta) at the chosen α, through f_lin for linear
    # vectors; the mean is their mean.
    addition = regime['addition']
    vectors = [checkpoint.load_task_vector(workdir_lib.task_vector_file(workdir, name, t))[0]
               for t in ('alpha', 'beta')]
    params = jax.tree.map(lambda t0, a, b: t0 + addition['alpha'] * (a + b), theta0,
                          vectors[0].delta, vectors[1].delta)
    for t, (pixels, labels) in tests.items():
      predicted = references.cosine_predictions(
          embeddings(name, apply_fn, theta0, params, pixels), heads[t])
      assert addition['test'][t] == np.mean(predicted == labels), (name, t)
    assert addition['mean_test'] == pytest.approx(np.mean([addition['test'][t] for t in tests]))
  # θ0 is the checkpoint's image tower, each head zero-shot from its text tower.
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


def test_merges_export_to_a_model_transformers_loads(finished, tmp_path):
  config, workdir, _ = finished
  config = copy.deepcopy(config)
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


def test_the_backdoor_experiment_runs_on_images_on_disk(finished, tmp_path):
  config, finished_workdir, _ = finished
  config = copy.deepcopy(config)
  config.regimes = 'full'
  config.safety.victims = 'alpha'
  # The converted CLIP, its zero-shot heads and the compiled programs of the finished run.
  workdir = str(tmp_path / 'work')
  shutil.copytree(finished_workdir, workdir)
  summary = safety.run(config, workdir)
  assert set(summary['fine_tunes'][0]) == {'clean/alpha', 'clean/beta', 'badnets/alpha'}
  # The pretrained model's clean accuracy and ASR, recomputed in numpy from its embeddings:
  # the share of test images classified right, and of those not of the target class that the
  # triggered image sends to the target.
  theta0, apply_fn = experiment.load_pretrained(workdir)
  target = config.poison.target
  for t in ('alpha', 'beta'):
    test = experiment.load_task(config, t).test
    head = checkpoint.load_tree(workdir_lib.head_file(workdir, t))[0]['head']
    pixels, labels = test.batch(np.arange(len(test)))
    triggered, _ = test.with_trigger(experiment.trigger(config, 'badnets')).batch(
        np.arange(len(test)))
    predict = lambda x, head=head: references.cosine_predictions(
        np.asarray(apply_fn(theta0, x)), head)
    assert summary['pretrained']['test'][t] == np.mean(predict(pixels) == labels), t
    assert summary['pretrained']['asr']['badnets'][t] == references.attack_success_rate(
        predict(triggered), labels, target), t
  # Each merge's scores: succession is the poisoned task's ASR, transfer the clean task's,
  # and the clean accuracy is the mean over the tasks.
  merges = {m['method']: m for m in summary['merges']}
  assert set(merges) == {'task_arithmetic', 'dam'}
  for m in merges.values():
    assert m['poisoned'] == ['alpha'] and set(m['asr']) == set(m['test']) == {'alpha', 'beta'}
    assert m['succession'] == m['asr']['alpha'] and m['transfer'] == m['asr']['beta']
    assert m['mean_test'] == pytest.approx(np.mean(list(m['test'].values())))


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
