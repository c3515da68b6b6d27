"""DAM: all-ones masks give AdaMerging, the backdoor-detection mask finds a planted trigger
response, no label is read, and a key fixes every draw."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from editing.task_vector import TaskVector
from merging import adamerging
from merging import common
from merging import dam

CLASSES = 6
# Clean pixel c is bright in images of class c; the trigger pixels and the inert pixels are 0 in
# every clean image.
CLEAN, TRIGGER, INERT = slice(0, CLASSES), slice(CLASSES, CLASSES + 2), slice(CLASSES + 2, None)
PIXELS = CLASSES + 4


def logits_fn(params, images):
  return (images[:, CLEAN] @ params['kernel'] + images[:, CLASSES:] @ params['backdoor'] +
          params['bias'])


def toy(seed=0, n=60):
  """θ0, two task vectors and their unlabeled data.

  Both vectors sharpen the clean diagonal. The first also carries a `backdoor` tensor: its
  planted rows send the trigger pixels to class 0; its inert rows add the same amount to
  every class, which changes no prediction. Entropy on clean inputs reads neither (their
  pixels are 0), so only the safe loss can tell the planted rows from the inert ones.
  """
  rng = np.random.default_rng(seed)
  theta0 = {'kernel': jnp.eye(CLASSES), 'backdoor': jnp.zeros((4, CLASSES)),
            'bias': jnp.zeros((CLASSES,))}
  vectors, data = [], {}
  for task in ('poisoned', 'clean'):
    backdoor = np.zeros((4, CLASSES), np.float32)
    if task == 'poisoned':
      backdoor[:2] = -10.0
      backdoor[:2, 0] = 10.0
      backdoor[2:] = 10.0
    delta = {'kernel': jnp.asarray(2 * np.eye(CLASSES) + rng.normal(scale=0.1,
                                                                    size=(CLASSES, CLASSES)),
                                   jnp.float32),
             'backdoor': jnp.asarray(backdoor), 'bias': jnp.zeros((CLASSES,))}
    vectors.append(TaskVector(delta, (task,), 'full', 'base'))
    # No input is of the target class: an untargeted perturbation then has every input's
    # gradient pointing at the trigger from the start (target-class inputs pull the other way).
    labels = 1 + np.arange(n) % (CLASSES - 1)
    images = np.zeros((n, PIXELS), np.float32)
    images[:, CLEAN] = rng.uniform(0.0, 0.3, size=(n, CLASSES))
    images[np.arange(n), labels] = rng.uniform(0.6, 1.0, size=n)
    data[task] = common.TaskData(logits_fn, images)
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
def test_the_backdoor_detection_mask_drops_the_planted_rows_and_keeps_the_inert_ones(oracle):
  theta0, vectors, data = toy()

  def trigger(images):
    triggered = np.array(images, copy=True)
    triggered[:, TRIGGER] = 1.0
    return triggered

  learned = dam.learn(vectors, theta0=theta0, data=data, key=jax.random.PRNGKey(0),
                      masks=('safe',), trigger=trigger if oracle else None, steps=40,
                      refit_steps=1, mask_learning_rate=0.1)
  mask = np.asarray(learned.masks['safe']['backdoor'])
  planted, inert = mask[:2].mean(), mask[2:].mean()
  assert planted <= 0.5 * inert, (planted, inert)
  # The safe loss is what tells them apart: without it neither row moves.
  unweighted = dam.learn(vectors, theta0=theta0, data=data, key=jax.random.PRNGKey(0),
                         masks=('safe',), trigger=trigger if oracle else None, steps=40,
                         refit_steps=1, mask_learning_rate=0.1, safety_weight=0.0)
  np.testing.assert_allclose(unweighted.masks['safe']['backdoor'], 1.0, rtol=1e-6)


def test_no_label_is_read_and_a_key_repeats_bit_for_bit():
  theta0, vectors, data = toy()
  garbage = {t: common.TaskData(d.logits_fn, d.images, np.full(len(d.images), -12345))
             for t, d in data.items()}
  settings = dict(theta0=theta0, steps=3, refit_steps=2, granularity='layer')
  first = dam.merge(vectors, data=data, key=jax.random.PRNGKey(1), **settings)
  # A second keyed run, reading garbage labels this time: the same bits.
  again = dam.merge(vectors, data=garbage, key=jax.random.PRNGKey(1), **settings)
  for a, b in zip(leaves(first.delta), leaves(again.delta)):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
  different = dam.merge(vectors, data=data, key=jax.random.PRNGKey(2), **settings)
  assert any(not np.array_equal(a, b) for a, b in zip(leaves(first.delta),
                                                       leaves(different.delta)))


def test_final_masks_are_the_rescaled_expectations():
  logits = {'a': jnp.array([[-1.0, 0.0], [2.0, -3.0]]), 'b': jnp.array([-50.0, -60.0])}
  mask = dam.final_mask(logits)
  expectation = 1 / (1 + np.exp(-np.array([[-1.0, 0.0], [2.0, -3.0]])))
  np.testing.assert_allclose(mask['a'], expectation / expectation.mean(), rtol=1e-6)
  np.testing.assert_allclose(mask['b'], [2.0, 0.0], atol=1e-3)  # e^-50 ≫ e^-60
  samples = dam.sampled_mask({'a': jnp.zeros((50, 40))}, jax.random.PRNGKey(0), 0.5)['a']
  np.testing.assert_allclose(float(samples.mean()), 1.0, rtol=1e-5)
  assert 0.0 <= float(samples.min()) and float(samples.max()) > 1.5


def test_unknown_masks_are_named():
  theta0, vectors, data = toy()
  with pytest.raises(ValueError, match="'task_shared'"):
    dam.learn(vectors, theta0=theta0, data=data, key=jax.random.PRNGKey(0),
              masks=('task_shared',))
