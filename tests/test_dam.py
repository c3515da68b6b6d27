"""DAM: all-ones masks give AdaMerging, the backdoor-detection mask finds a planted trigger
response, no label is read, and a key fixes every draw."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from editing.task_vector import TaskVector
from merging import adamerging
from merging import base
from merging import dam

CLASSES = 3
CLEAN_PIXELS, TRIGGER_PIXELS = 4, 2


def logits_fn(params, images):
  """A linear classifier; its last TRIGGER_PIXELS rows read pixels clean inputs leave at 0."""
  return images @ params['kernel'] + params['bias']


def toy(seed=0, n=64):
  """θ0, two task vectors (the first with a planted trigger response to class 0 in the trigger
  rows of the kernel, which share the tensor with the clean rows), and data."""
  rng = np.random.default_rng(seed)
  pixels = CLEAN_PIXELS + TRIGGER_PIXELS
  theta0 = {'kernel': jnp.asarray(rng.normal(size=(pixels, CLASSES)), jnp.float32).at[
      CLEAN_PIXELS:].set(0.0), 'bias': jnp.zeros((CLASSES,), jnp.float32)}
  vectors = []
  for task in ('poisoned', 'clean'):
    kernel = rng.normal(size=(pixels, CLASSES)).astype(np.float32)
    kernel[CLEAN_PIXELS:] = 0.0
    if task == 'poisoned':
      kernel[CLEAN_PIXELS:] = -30.0
      kernel[CLEAN_PIXELS:, 0] = 30.0
    delta = {'kernel': jnp.asarray(kernel),
             'bias': jnp.asarray(rng.normal(size=(CLASSES,)), jnp.float32)}
    vectors.append(TaskVector(delta, (task,), 'full', 'base'))
  data = {}
  for task in ('poisoned', 'clean'):
    images = np.zeros((n, CLEAN_PIXELS + TRIGGER_PIXELS), np.float32)
    images[:, :CLEAN_PIXELS] = rng.uniform(size=(n, CLEAN_PIXELS))
    data[task] = base.TaskData(logits_fn, images)
  return theta0, vectors, data


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_with_all_ones_masks_dam_is_adamerging():
  theta0, vectors, data = toy()
  key = jax.random.PRNGKey(3)
  expected = adamerging.learn(vectors, theta0=theta0, data=data, key=key, steps=6)
  # Logits of +50 sample to exactly 1 and a zero learning rate keeps them there: the inner
  # steps are AdaMerging's, and the refit is AdaMerging itself.
  learned = dam.learn(vectors, theta0=theta0, data=data, key=key, steps=6, refit_steps=6,
                      mask_init=50.0, mask_learning_rate=0.0)
  np.testing.assert_allclose([o['entropy'] for o in learned.objectives], expected.entropies,
                             rtol=1e-6)
  for mask in learned.masks.values():
    for leaf in leaves(mask):
      np.testing.assert_array_equal(leaf, 1.0)
  np.testing.assert_array_equal(learned.coefficients, expected.coefficients)
  unmasked = dam.merge(vectors, theta0=theta0, data=data, key=key, masks=(), refit_steps=6)
  merged = adamerging.merge(vectors, theta0=theta0, data=data, key=key, steps=6)
  for a, b in zip(leaves(unmasked.delta), leaves(merged.delta)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('oracle', [False, True])
def test_the_backdoor_detection_mask_drops_the_planted_trigger_block(oracle):
  theta0, vectors, data = toy()

  def trigger(images):
    triggered = np.array(images, copy=True)
    triggered[:, CLEAN_PIXELS:] = 1.0
    return triggered

  learned = dam.learn(vectors, theta0=theta0, data=data, key=jax.random.PRNGKey(0),
                      masks=('safe',), trigger=trigger if oracle else None, steps=40,
                      refit_steps=1, mask_learning_rate=0.1)
  kept = np.asarray(learned.masks['safe']['kernel']) > 0
  trigger_rows, clean_rows = kept[CLEAN_PIXELS:].mean(), kept[:CLEAN_PIXELS].mean()
  assert trigger_rows <= clean_rows - 0.5, (trigger_rows, clean_rows)
  assert all(o['safety'] >= 0 for o in learned.objectives)


def test_no_label_is_read_and_a_key_repeats_bit_for_bit():
  theta0, vectors, data = toy()
  garbage = {t: base.TaskData(d.logits_fn, d.images, np.full(len(d.images), -12345))
             for t, d in data.items()}
  settings = dict(theta0=theta0, steps=3, refit_steps=2, granularity='layer')
  first = dam.merge(vectors, data=data, key=jax.random.PRNGKey(1), **settings)
  for other in (dam.merge(vectors, data=garbage, key=jax.random.PRNGKey(1), **settings),
                dam.merge(vectors, data=data, key=jax.random.PRNGKey(1), **settings)):
    for a, b in zip(leaves(first.delta), leaves(other.delta)):
      np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
  different = dam.merge(vectors, data=data, key=jax.random.PRNGKey(2), **settings)
  assert any(not np.array_equal(a, b) for a, b in zip(leaves(first.delta),
                                                       leaves(different.delta)))


def test_final_masks_are_the_rescaled_thresholds():
  logits = {'a': jnp.array([[-1.0, 0.0], [2.0, -3.0]]), 'b': jnp.array([-1.0, -2.0])}
  mask = dam.final_mask(logits)
  np.testing.assert_array_equal(mask['a'], [[0.0, 2.0], [2.0, 0.0]])
  np.testing.assert_array_equal(mask['b'], [0.0, 0.0])
  samples = dam.sampled_mask({'a': jnp.zeros((50, 40))}, jax.random.PRNGKey(0), 0.5)['a']
  np.testing.assert_allclose(float(samples.mean()), 1.0, rtol=1e-5)
  assert 0.0 <= float(samples.min()) and float(samples.max()) > 1.5


def test_unknown_masks_are_named():
  theta0, vectors, data = toy()
  with pytest.raises(ValueError, match="'task_shared'"):
    dam.learn(vectors, theta0=theta0, data=data, key=jax.random.PRNGKey(0),
              masks=('task_shared',))
