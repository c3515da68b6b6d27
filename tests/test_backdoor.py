"""The backdoor threat model: triggers, poisoning, and the attack success rate."""

import numpy as np
import pytest

from editing import evaluate
from editing.data import triggers
from editing.data.suite import Dataset

RNG = np.random.default_rng(0)
IMAGES = RNG.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)


@pytest.mark.parametrize('trigger', [triggers.BadNets(), triggers.Blended()])
@pytest.mark.parametrize('as_float', [False, True])
def test_triggers_are_deterministic_and_keep_dtype_and_range(trigger, as_float):
  images = IMAGES.astype(np.float32) / 255 if as_float else IMAGES
  out = trigger(images)
  assert out.dtype == images.dtype and out.shape == images.shape
  assert out.min() >= 0 and out.max() <= (1 if as_float else 255)
  np.testing.assert_array_equal(out, trigger(images))
  assert not np.array_equal(out, images)
  np.testing.assert_array_equal(images, IMAGES.astype(np.float32) / 255 if as_float else IMAGES)


def test_badnets_changes_only_its_patch_and_the_patch_is_the_same_everywhere():
  trigger = triggers.BadNets(size=4, margin=1)
  out = trigger(IMAGES)
  rows, cols = trigger.region(32, 32)
  outside = np.ones((32, 32), bool)
  outside[rows, cols] = False
  np.testing.assert_array_equal(out[:, outside], IMAGES[:, outside])
  patch = out[:, rows, cols]
  assert set(np.unique(patch)) == {0, 255} and (patch == patch[:1]).all()


def test_blended_mixes_a_fixed_pattern_at_its_ratio():
  trigger = triggers.Blended(ratio=0.2, seed=3)
  images = IMAGES.astype(np.float32) / 255
  expected = 0.8 * images + 0.2 * trigger.pattern(images.shape[1:])
  np.testing.assert_allclose(trigger(images), expected, atol=1e-6)
  assert not np.array_equal(trigger.pattern((32, 32, 3)),
                            triggers.Blended(seed=4).pattern((32, 32, 3)))


def test_poison_triggers_and_relabels_exactly_the_rate():
  labels = RNG.integers(0, 5, 50).astype(np.int32)
  data = Dataset(RNG.integers(0, 256, (50, 32, 32, 3), dtype=np.uint8), labels)
  poisoned = triggers.poison(data, triggers.BadNets(), rate=0.1, target=0, seed=1)
  changed = np.flatnonzero((poisoned.images != data.images).any(axis=(1, 2, 3)))
  assert len(changed) == 5 and (poisoned.labels[changed] == 0).all()
  untouched = np.setdiff1d(np.arange(50), changed)
  np.testing.assert_array_equal(poisoned.labels[untouched], labels[untouched])
  again = triggers.poison(data, triggers.BadNets(), rate=0.1, target=0, seed=1)
  np.testing.assert_array_equal(again.images, poisoned.images)


def test_attack_success_rate_leaves_out_the_target_class():
  labels = np.array([0, 0, 1, 2, 3, 1])
  predictions = np.array([0, 2, 0, 0, 3, 1])  # of the four non-target inputs, two hit 0
  assert evaluate.attack_success_rate(predictions, labels, target=0) == 0.5
  assert evaluate.attack_success_rate(predictions, labels, target=2) == 0.2
  with pytest.raises(ValueError, match='target 0'):
    evaluate.attack_success_rate(predictions[:2], labels[:2], target=0)
