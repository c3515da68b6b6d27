"""The task-vector algebra: laws, provenance checks and errors that name the path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from editing import tree as tree_lib
from editing.task_vector import TaskVector


def random_params(seed, shapes=None):
  shapes = shapes or {'blocks_0': {'attn': {'query': {'kernel': (4, 2, 3)}}, 'ln': {'scale': (4,)}},
                      'proj': {'kernel': (4, 5)}}
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
  return jax.tree.map(lambda s: jax.random.normal(next(keys), s), shapes,
                      is_leaf=lambda s: isinstance(s, tuple))


def make_vector(base, seed, task='a', regime='full'):
  return TaskVector.from_params(base, random_params(seed), task=task, regime=regime)


BASE = random_params(0)


def assert_bitwise_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def test_from_params_is_the_difference():
  finetuned = random_params(1)
  vector = TaskVector.from_params(BASE, finetuned, task='a', regime='full')
  expected = jax.tree.map(lambda f, b: f - b, finetuned, BASE)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=0), vector.delta,
               expected)
  assert vector.tasks == ('a',) and vector.regime == 'full'
  assert vector.base == tree_lib.fingerprint(BASE)


def test_vector_plus_its_negation_is_zero():
  vector = make_vector(BASE, 1)
  for leaf in jax.tree.leaves((vector + (-vector)).delta):
    np.testing.assert_array_equal(leaf, 0)


def test_apply_with_alpha_zero_returns_the_base_bit_for_bit():
  vector = make_vector(BASE, 1)
  assert_bitwise_equal(vector.apply_to(BASE, 0.0), BASE)
  assert_bitwise_equal(jax.jit(lambda b, v: v.apply_to(b, 0.0))(BASE, vector), BASE)


def test_apply_with_alpha_one_recovers_the_finetuned_params():
  finetuned = random_params(1)
  vector = TaskVector.from_params(BASE, finetuned, task='a', regime='full')
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=1e-6),
               vector.apply_to(BASE, 1.0), finetuned)


def test_apply_keeps_the_base_dtype():
  base16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), BASE)
  vector = TaskVector(jax.tree.map(jnp.ones_like, BASE), ('a',), 'full', 'x')
  for leaf in jax.tree.leaves(vector.apply_to(base16, 0.5)):
    assert leaf.dtype == jnp.bfloat16


def test_sum_does_not_depend_on_order():
  vectors = [make_vector(BASE, s, task=f't{s}') for s in range(1, 6)]
  forward, backward = sum(vectors), sum(reversed(vectors))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6),
               forward.delta, backward.delta)
  assert set(forward.tasks) == {f't{s}' for s in range(1, 6)}


def test_scalar_multiplication_and_subtraction():
  a, b = make_vector(BASE, 1), make_vector(BASE, 2, task='b')
  jax.tree.map(lambda x, y, z: np.testing.assert_allclose(x, 2 * y - z, rtol=1e-6, atol=1e-6),
               (2 * a - b).delta, a.delta, b.delta)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, 0.5 * y), (a * 0.5).delta, a.delta)


def test_norm_cosine_and_sparsity_match_numpy():
  a, b = make_vector(BASE, 1), make_vector(BASE, 2, task='b')
  flat_a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a.delta)])
  flat_b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b.delta)])
  np.testing.assert_allclose(a.norm(), np.linalg.norm(flat_a), rtol=1e-5)
  np.testing.assert_allclose(
      a.cosine(b), flat_a @ flat_b / np.linalg.norm(flat_a) / np.linalg.norm(flat_b), rtol=1e-5)
  np.testing.assert_allclose(a.cosine(a), 1.0, rtol=1e-5)
  half = a.replace(delta=jax.tree.map(lambda x: x.at[..., ::2].set(0), a.delta))
  zeros = sum(int(np.sum(np.asarray(x) == 0)) for x in jax.tree.leaves(half.delta))
  np.testing.assert_allclose(half.sparsity(), zeros / flat_a.size, rtol=1e-6)
  assert a.sparsity() == 0


def test_algebra_under_jit():
  a, b = make_vector(BASE, 1), make_vector(BASE, 2, task='b')
  combined = jax.jit(lambda x, y, c: (x + c * y).apply_to(BASE, 0.3))(a, b, 2.0)
  eager = (a + 2.0 * b).apply_to(BASE, 0.3)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6), combined,
               eager)


def test_mismatched_tree_error_names_the_path():
  other = random_params(1)
  other['blocks_0']['attn']['query']['kernel'] = jnp.zeros((4, 2, 7))
  vector = make_vector(BASE, 1)
  odd = TaskVector(other, ('b',), 'full', vector.base)
  with pytest.raises(ValueError, match='blocks_0/attn/query/kernel'):
    vector + odd
  missing = {'blocks_0': BASE['blocks_0']}
  with pytest.raises(ValueError, match='proj/kernel'):
    vector.apply_to(missing)


def test_different_regimes_or_bases_do_not_combine():
  a = make_vector(BASE, 1)
  with pytest.raises(ValueError, match='regimes'):
    a + make_vector(BASE, 2, regime='linearized')
  with pytest.raises(ValueError, match='different base'):
    a + make_vector(random_params(9), 2)
