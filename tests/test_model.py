"""The ViT: shapes, addressable attention leaves, and the ViT-B/32 size."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from configs import quickstart
from editing import tree as tree_lib
from editing.models import head as head_lib
from editing.models import vit


def test_default_encoder_shapes_and_size():
  config = quickstart.get_config().model
  module = vit.build(config)
  images = jnp.zeros((3, 32, 32, 3))
  params = module.init(jax.random.PRNGKey(0), images)['params']
  out = module.apply({'params': params}, images)
  assert out.shape == (3, config.embed_dim) and out.dtype == jnp.float32
  assert 0.7e6 < tree_lib.num_params(params) < 1.3e6
  flat = tree_lib.flatten(params)
  for i in range(config.depth):
    for name in ('query', 'key', 'value', 'out'):
      assert f'blocks_{i}/attn/{name}/kernel' in flat
  assert flat['blocks_0/attn/query/kernel'].shape == (128, 4, 32)
  assert flat['blocks_0/attn/out/kernel'].shape == (4, 32, 128)


def test_vit_b32_builds_with_the_published_parameter_count():
  config = ml_collections.ConfigDict(dict(patch_size=32, width=768, depth=12, num_heads=12,
                                          mlp_dim=3072, embed_dim=512))
  module = vit.build(config)
  shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3)))
  # CLIP ViT-B/32's image encoder has 87.85M parameters (patch conv without bias).
  assert abs(tree_lib.num_params(shapes['params']) - 87_849_216) < 1_000


def test_encoder_depends_on_every_image_and_not_on_the_rest_of_the_batch():
  module = vit.build(quickstart.get_config('tiny').model)
  images = jax.random.uniform(jax.random.PRNGKey(1), (4, 32, 32, 3))
  params = module.init(jax.random.PRNGKey(0), images)['params']
  together = module.apply({'params': params}, images)
  alone = module.apply({'params': params}, images[:1])
  np.testing.assert_allclose(together[:1], alone, rtol=1e-5, atol=1e-5)
  assert not np.allclose(together[0], together[1])


def test_prototype_head_classifies_its_own_class_means():
  rng = np.random.default_rng(0)
  centres = rng.normal(size=(3, 8)).astype(np.float32)
  labels = np.repeat(np.arange(3), 20)
  features = centres[labels] + 0.05 * rng.normal(size=(60, 8)).astype(np.float32)
  head = head_lib.fit_prototypes(features, labels, 3)
  np.testing.assert_allclose(np.linalg.norm(head, axis=1), 1.0, rtol=1e-5)
  logits = head_lib.logits(jnp.asarray(features), jnp.asarray(head), 10.0)
  assert np.all(np.argmax(logits, -1) == labels)
  assert np.abs(logits).max() <= 10.0 + 1e-4


def test_a_padded_head_has_the_loss_gradient_and_predictions_of_its_classes():
  rng = np.random.default_rng(1)
  features = rng.normal(size=(12, 8)).astype(np.float32)
  head = rng.normal(size=(5, 8)).astype(np.float32)
  labels = rng.integers(0, 5, 12)
  padded = head_lib.padded(head)
  assert padded.shape == (16, 8) and head_lib.padded(np.ones((10, 8), np.float32)).shape == (16, 8)
  # The reference: cross-entropy over the five cosine logits, in float64.
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  cosines = 30.0 * unit(features.astype(np.float64)) @ unit(head.astype(np.float64)).T
  log_p = cosines - np.log(np.exp(cosines).sum(axis=1, keepdims=True))
  expected = -log_p[np.arange(12), labels].mean()
  loss_fn = head_lib.frozen_head_loss(lambda theta0, params, x: x + params['shift'], 30.0)
  loss_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
  params = {'shift': jnp.zeros(8)}
  (loss, metrics), grads = loss_and_grad(params, {'theta0': None, 'head': padded},
                                         jnp.asarray(features), labels, None)
  (_, _), unpadded_grads = loss_and_grad(params, {'theta0': None, 'head': jnp.asarray(head)},
                                         jnp.asarray(features), labels, None)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  assert np.abs(unpadded_grads['shift']).max() > 1e-2
  np.testing.assert_allclose(grads['shift'], unpadded_grads['shift'], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics['accuracy'], np.mean(np.argmax(cosines, 1) == labels))
