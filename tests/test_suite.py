"""The offline suite: determinism, disjoint splits, label ranges, stateless batch order."""

import colorsys
import hashlib

import numpy as np
import pytest

from editing.data import render
from editing.data import suite

SMALL = dict(train_size=200, test_size=60)


def digest(dataset):
  return hashlib.sha256(dataset.images.tobytes() + dataset.labels.tobytes()).hexdigest()


@pytest.mark.parametrize('name', suite.TASKS)
def test_task_is_well_formed(name):
  task = suite.load_task(name, seed=0, **SMALL)
  for split in (task.train, task.val, task.test):
    assert split.images.dtype == np.uint8 and split.images.shape[1:] == (32, 32, 3)
    assert split.labels.dtype == np.int32 and len(split.images) == len(split.labels)
    assert split.labels.min() >= 0 and split.labels.max() < task.num_classes
  assert len(task.val) == round(0.1 * (len(task.train) + len(task.val)))
  # Every class appears in training (the frozen heads need every prototype).
  assert len(np.unique(task.train.labels)) == task.num_classes
  images, labels = task.train.batch(np.array([0, 1]))
  assert images.dtype == np.float32 and 0.0 <= images.min() and images.max() <= 1.0


@pytest.mark.parametrize('name', ['shapes', 'digits', 'count'])
def test_same_seed_gives_the_same_bytes_and_another_seed_does_not(name):
  suite.load_task.cache_clear()
  first = suite.load_task(name, seed=3, **SMALL)
  suite.load_task.cache_clear()
  again = suite.load_task(name, seed=3, **SMALL)
  other = suite.load_task(name, seed=4, **SMALL)
  for split in ('train', 'val', 'test'):
    assert digest(getattr(first, split)) == digest(getattr(again, split))
    assert digest(getattr(first, split)) != digest(getattr(other, split))


@pytest.mark.parametrize('name', suite.TASKS)
def test_splits_share_no_image(name):
  task = suite.load_task(name, seed=0, **SMALL)
  seen = {}
  for split in ('train', 'val', 'test'):
    for image in getattr(task, split).images:
      key = image.tobytes()
      assert seen.setdefault(key, split) == split, f'an image of {split} is also in {seen[key]}'


def test_each_downstream_task_is_a_domain_of_its_own():
  """Every image's border (the median of its edge pixels) has the hue of its own task's
  backgrounds, nearer to it than to any other task's; the colour task's is grey."""
  looks = {name: look for name, look in suite.LOOKS.items() if name != 'texture'}
  for name in suite.DOWNSTREAM_TASKS:
    images = suite.load_task(name, seed=1, **SMALL).test.images.astype(np.float32) / 255
    edges = np.concatenate([images[:, 0], images[:, -1], images[:, :, 0], images[:, :, -1]], 1)
    hsv = np.array([colorsys.rgb_to_hsv(*rgb) for rgb in np.median(edges, axis=1)])
    if name == 'colour':
      assert hsv[:, 1].max() < 0.05
    elif name != 'texture':  # its patterns mix its two hues up to the edge
      distance = {other: np.abs((hsv[:, 0] - look.background + 0.5) % 1 - 0.5)
                  for other, look in looks.items()}
      nearest = np.array(list(distance))[np.argmin(np.stack(list(distance.values())), 0)]
      assert (nearest == name).all(), (name, sorted(set(nearest)))


def test_unknown_task_is_named_in_the_error():
  with pytest.raises(ValueError, match='unknown task .nope.'):
    suite.load_task('nope')


def test_batch_indices_are_a_pure_function_of_the_step():
  n, batch = 50, 8
  steps_per_epoch = n // batch
  epoch0 = np.concatenate(
      [suite.batch_indices(n, batch, s, seed=1) for s in range(steps_per_epoch)])
  assert len(np.unique(epoch0)) == len(epoch0)  # no repeats within an epoch
  np.testing.assert_array_equal(suite.batch_indices(n, batch, 3, seed=1),
                                suite.batch_indices(n, batch, 3, seed=1))
  assert not np.array_equal(suite.batch_indices(n, batch, 0, seed=1),
                            suite.batch_indices(n, batch, steps_per_epoch, seed=1))
  with pytest.raises(ValueError, match='exceeds'):
    suite.batch_indices(4, 8, 0, seed=0)


def test_shapes_are_distinct_under_rotation():
  # No two shapes of the control task may coincide at some rotation, or its labels are noise.
  masks = {s: [render.shape_mask(s, 16, 16, 8, a) for a in np.linspace(0, 2 * np.pi, 24)]
           for s in render.SHAPES}
  for i, a in enumerate(render.SHAPES):
    for b in render.SHAPES[i + 1:]:
      closest = min(np.mean(x != y) for x in masks[a] for y in masks[b])
      assert closest > 0.03, (a, b, closest)
