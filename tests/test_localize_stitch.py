"""Localize-and-Stitch (merging/localize_stitch.py) against numpy: the stitching of masks, the
dataless masks, and the learned masks' score steps on a softmax-regression model whose
gradient numpy writes in closed form; with the defining properties."""

import jax.numpy as jnp
import numpy as np

from editing.task_vector import TaskVector
from merging import localize_stitch

RNG = np.random.default_rng(0)


def _vectors(count=3, shape=(6, 4)):
  return [TaskVector({'w': RNG.standard_normal(shape).astype(np.float32),
                      'b': RNG.standard_normal(shape[1]).astype(np.float32)},
                     (f't{i}',), 'full', 'base') for i in range(count)]


def _numpy_top(vector, share):
  """Boolean masks of the max(1, ⌊share·n⌋) largest |τ| over the whole vector (ties to the
  earlier entry, leaves in path order b, w)."""
  flat = np.concatenate([np.abs(vector.delta[k]).ravel() for k in ('b', 'w')])
  kept = max(1, int(share * flat.size))
  order = np.argsort(-flat, kind='stable')[:kept]
  mask = np.zeros(flat.size, bool)
  mask[order] = True
  size_b = vector.delta['b'].size
  return {'b': mask[:size_b].reshape(vector.delta['b'].shape),
          'w': mask[size_b:].reshape(vector.delta['w'].shape)}


def _numpy_stitch(vectors, masks):
  out = {}
  for k in ('b', 'w'):
    count = sum(m[k].astype(float) for m in masks)
    total = sum(np.where(m[k], v.delta[k], 0) for v, m in zip(vectors, masks))
    out[k] = np.where(count > 0, total / np.maximum(count, 1), 0)
  return out


def test_dataless_masks_and_stitching_equal_numpy():
  vectors = _vectors()
  merged = localize_stitch.merge_dataless(vectors, sparsity=0.3)
  expected = _numpy_stitch(vectors, [_numpy_top(v, 0.3) for v in vectors])
  for k in ('b', 'w'):
    np.testing.assert_allclose(merged.delta[k], expected[k], rtol=1e-6)


def test_stitching_keeps_each_region_and_averages_overlaps():
  vectors = _vectors(2)
  only_first = {'w': np.zeros((6, 4), bool), 'b': np.array([True, True, False, False])}
  only_first['w'][0] = True
  both = {'w': np.zeros((6, 4), bool), 'b': np.array([False, True, True, False])}
  merged = localize_stitch.stitch(vectors, [only_first, both])
  d0, d1 = vectors[0].delta['b'], vectors[1].delta['b']
  np.testing.assert_allclose(merged.delta['b'], [d0[0], (d0[1] + d1[1]) / 2, d1[2], 0],
                             rtol=1e-6)
  np.testing.assert_allclose(merged.delta['w'][0], vectors[0].delta['w'][0])
  assert not np.any(merged.delta['w'][1:])


def _numpy_localize(theta0, vector, x, y, share, bias, lr, l1, epochs):
  """The score steps with the mean cross-entropy gradient of logits = x W + b in closed form."""
  masks = _numpy_top(vector, share)
  scores = {k: np.where(masks[k], bias, -bias) for k in ('w', 'b')}
  onehot = np.eye(vector.delta['b'].size)[y]
  for _ in range(epochs):
    gates = {k: 1 / (1 + np.exp(-scores[k])) for k in scores}
    w = theta0['w'] + gates['w'] * vector.delta['w']
    b = theta0['b'] + gates['b'] * vector.delta['b']
    z = x @ w + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    grads = {'w': x.T @ (p - onehot) / len(x), 'b': (p - onehot).mean(0)}
    scores = {k: scores[k] - (lr * grads[k] * vector.delta[k] + l1) * gates[k] * (1 - gates[k])
              for k in scores}
  return {k: scores[k] > 0 for k in scores}


def test_learned_masks_equal_the_numpy_score_steps():
  vector = _vectors(1)[0]
  theta0 = {'w': RNG.standard_normal((6, 4)).astype(np.float32),
            'b': np.zeros(4, np.float32)}
  x = RNG.standard_normal((40, 6)).astype(np.float32)
  y = RNG.integers(0, 4, 40)
  logits_fn = lambda params, inputs: inputs @ params['w'] + params['b']
  settings = dict(sparsity=0.2, sigmoid_bias=1.0, lr=30.0, l1=0.5, epochs=3)
  ours = localize_stitch.localize(logits_fn, theta0, vector, x, y, batch_size=16, **settings)
  expected = _numpy_localize(theta0, vector, x, y, share=0.2, bias=1.0, lr=30.0, l1=0.5,
                             epochs=3)
  start = _numpy_top(vector, 0.2)
  for k in ('b', 'w'):
    np.testing.assert_array_equal(np.asarray(ours[k]), expected[k])
  # The steps moved the masks off their start; with no step they stay there.
  assert any(np.any(expected[k] != start[k]) for k in ('b', 'w'))
  still = localize_stitch.localize(logits_fn, theta0, vector, x, y, batch_size=16,
                                   **{**settings, 'lr': 0.0, 'l1': 0.0})
  for k in ('b', 'w'):
    np.testing.assert_array_equal(np.asarray(still[k]), start[k])
  assert jnp.asarray(ours['w']).dtype == jnp.bool_
