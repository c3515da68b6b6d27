"""The evaluation protocols: α selection for addition and negation, and batched accuracy."""

import jax.numpy as jnp
import numpy as np
import pytest

from editing import evaluate
from editing import sharding
from editing.data.suite import Dataset
from editing.task_vector import TaskVector


class ScalarModelEvaluator:
  """An evaluator over a one-number model θ: accuracy(θ, head) = head(θ); edit is θ0 + α·τ."""

  def edit(self, theta0, vector, alpha):
    return vector.apply_to(theta0, alpha)

  def accuracies(self, theta0, params, scored):
    del theta0
    return {key: float(head(float(params['theta']), data))
            for key, (head, data) in scored.items()}


def vector(value=1.0):
  return TaskVector({'theta': jnp.float32(value)}, ('t',), 'full', 'base')


THETA0 = {'theta': jnp.float32(0.0)}
GRID = evaluate.alpha_grid(0.05)


def test_alpha_grid():
  assert GRID[:3] == [0.0, 0.05, 0.1] and GRID[-1] == 1.0 and len(GRID) == 21


def test_addition_picks_the_alpha_of_best_mean_normalized_validation_accuracy():
  # Task a peaks at θ = 0.3, task b at θ = 0.5; b's fine-tuned accuracy is half of a's, so its
  # normalized accuracy weighs double and the best mean lies nearer 0.5.
  heads = {'a': lambda th, d: (1 - abs(th - 0.3)) * (0.9 if d == 'test' else 1.0),
           'b': lambda th, d: 0.5 * (1 - 2 * abs(th - 0.5))}
  finetuned = {'a': {'val': 1.0, 'test': 0.9}, 'b': {'val': 0.5, 'test': 0.5}}
  result = evaluate.task_addition(
      ScalarModelEvaluator(), THETA0, vector(), heads=heads, val={'a': 'val', 'b': 'val'},
      test={'a': 'test', 'b': 'test'}, finetuned=finetuned, alphas=GRID)
  scores = {p['alpha']: p['normalized_val'] for p in result['curve']}
  assert result['alpha'] == max(scores, key=scores.get) == 0.5
  np.testing.assert_allclose(result['test']['a'], 0.8 * 0.9, rtol=1e-6)
  np.testing.assert_allclose(result['normalized_test']['a'], 0.8, rtol=1e-6)
  np.testing.assert_allclose(result['normalized_test']['b'], 1.0, rtol=1e-6)


def test_negation_minimises_the_target_under_the_control_constraint():
  # Target accuracy falls with α; control holds until α = 0.6, then collapses below 95%.
  target = lambda th, d: 0.9 + th  # θ = −α
  control = lambda th, d: 0.8 if th > -0.6 - 1e-6 else 0.5
  result = evaluate.task_negation(
      ScalarModelEvaluator(), THETA0, vector(), head=target, val='val', test='test',
      control_head=control, control_val='val', control_test='test', alphas=GRID)
  assert result['alpha'] == 0.6
  np.testing.assert_allclose(result['target_test'], 0.3, rtol=1e-5)
  assert result['control_test'] == 0.8


def test_negation_needs_alpha_zero_in_the_grid():
  with pytest.raises(ValueError, match='alpha=0'):
    evaluate.task_negation(ScalarModelEvaluator(), THETA0, vector(), head=None, val=None,
                           test=None, control_head=None, control_val=None, control_test=None,
                           alphas=[0.5, 1.0])


def test_evaluator_accuracy_handles_a_partial_last_batch():
  # A 'model' whose embedding is the mean colour: the head tells red from blue images.
  rng = np.random.default_rng(0)
  labels = rng.integers(2, size=37).astype(np.int32)
  images = np.zeros((37, 32, 32, 3), np.uint8)
  images[labels == 0, ..., 0] = 200
  images[labels == 1, ..., 2] = 200
  labels[:5] = 1 - labels[:5]  # five wrong labels
  encoder = lambda theta0, params, x: x.mean(axis=(1, 2)) * params['scale']
  evaluator = evaluate.Evaluator(encoder, mesh=sharding.make_mesh(1),
                                 batch_size=16)
  head = jnp.eye(3)[jnp.array([0, 2])]
  params = {'scale': jnp.float32(1.0)}
  accuracy = evaluator.accuracy(params, params, head, Dataset(images, labels))
  np.testing.assert_allclose(accuracy, 32 / 37, rtol=1e-6)
  edited = evaluator.edit(params, TaskVector({'scale': jnp.float32(2.0)}, ('t',), 'full', 'b'),
                          0.5)
  np.testing.assert_allclose(edited['scale'], 2.0)


def test_sweeping_alpha_datasets_and_heads_compiles_once():
  encoder = lambda theta0, params, x: x.mean(axis=(1, 2)) * params['scale']
  evaluator = evaluate.Evaluator(encoder, mesh=sharding.make_mesh(1),
                                 batch_size=8)
  theta0 = {'scale': jnp.float32(1.0)}
  vector = TaskVector({'scale': jnp.float32(0.5)}, ('t',), 'full', 'b')
  rng = np.random.default_rng(0)
  datasets = [Dataset(rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8),
                      rng.integers(0, 3, n).astype(np.int32)) for n in (5, 19)]
  for alpha in evaluate.alpha_grid(0.25):
    params = evaluator.edit(theta0, vector, alpha)
    for data, head in zip(datasets, (jnp.eye(3), jnp.eye(3)[:2])):
      evaluator.accuracy(theta0, params, head, data)
  assert evaluator._apply._cache_size() == 1  # pylint: disable=protected-access
  assert evaluator._encode._cache_size() == 1  # pylint: disable=protected-access


def colour_model(batch_size=16):
  """An encoder whose embedding is an image's mean colour, and random images with labels."""
  encoder = lambda theta0, params, x: x.mean(axis=(1, 2)) * params['scale']
  evaluator = evaluate.Evaluator(encoder, mesh=sharding.make_mesh(1),
                                 batch_size=batch_size)
  rng = np.random.default_rng(3)
  datasets = [Dataset(rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8),
                      rng.integers(0, 3, n).astype(np.int32)) for n in (7, 40, 3)]
  return evaluator, {'scale': jnp.float32(1.0)}, datasets


def test_datasets_scored_together_are_each_scored_as_alone():
  # Their images share batches; each head must still read its own dataset's rows, in order.
  evaluator, params, datasets = colour_model()
  heads = [jnp.eye(3), jnp.eye(3)[::-1], jnp.eye(3)[:2]]
  scored = dict(zip('abc', zip(heads, datasets)))
  together = evaluator.predict(params, params, scored)
  for key, (head, data) in scored.items():
    colours = data.images.astype(np.float64).mean(axis=(1, 2))
    directions = np.asarray(head, np.float64)
    expected = np.argmax(colours / np.linalg.norm(colours, axis=1, keepdims=True)
                         @ directions.T, axis=1)
    np.testing.assert_array_equal(together[key], expected)
  accuracies = evaluator.accuracies(params, params, scored)
  assert accuracies == {k: float(np.mean(together[k] == d.labels))
                        for k, (_, d) in scored.items()}


def test_weight_disentanglement_logs_its_progress(caplog):
  evaluator, theta0, vectors, heads, data = two_task_toy(entangled=True)
  with caplog.at_level('INFO'):
    evaluate.disentanglement(evaluator, theta0, vectors, heads=heads, data=data,
                             alphas=evaluate.disentanglement_grid(2.0, 3))
  assert 'weight disentanglement: 15/15 edits' in caplog.text and 'eta' in caplog.text


def two_task_toy(entangled: bool):
  """A model whose task 1 reads features (0, 1), moved by θ['a'], and task 2 features (2, 3),
  moved by θ['b'] and, when entangled, also by θ['a']."""
  rng = np.random.default_rng(1)
  data = [Dataset(rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8),
                  rng.integers(0, 2, n).astype(np.int32)) for n in (13, 21)]

  def encoder(theta0, params, x):
    del theta0
    m = x.mean(axis=(1, 2, 3)) - 0.5
    a, b = params['a'], params['b'] + (params['a'] if entangled else 0.0)
    return jnp.stack([m + a, -(m + a) + 0.01, m + b, -(m + b) + 0.01], axis=-1)

  evaluator = evaluate.Evaluator(encoder, mesh=sharding.make_mesh(1),
                                 batch_size=16)
  heads = (jnp.eye(4)[:2], jnp.eye(4)[2:])
  theta0 = {'a': jnp.float32(0.0), 'b': jnp.float32(0.0)}
  vectors = (TaskVector({'a': jnp.float32(0.03), 'b': jnp.float32(0.0)}, ('1',), 'full', 'b'),
             TaskVector({'a': jnp.float32(0.0), 'b': jnp.float32(-0.05)}, ('2',), 'full', 'b'))
  return evaluator, theta0, vectors, heads, data


def test_disentanglement_is_zero_when_the_tasks_read_disjoint_parameters():
  evaluator, theta0, vectors, heads, data = two_task_toy(entangled=False)
  xi = evaluate.disentanglement(evaluator, theta0, vectors, heads=heads, data=data,
                                alphas=evaluate.disentanglement_grid(2.0, 5))
  assert xi.shape == (5, 5)
  np.testing.assert_array_equal(xi, 0.0)


def test_disentanglement_follows_its_definition():
  evaluator, theta0, vectors, heads, data = two_task_toy(entangled=True)
  alphas = evaluate.disentanglement_grid(2.0, 5)
  xi = evaluate.disentanglement(evaluator, theta0, vectors, heads=heads, data=data,
                                alphas=alphas)
  predict = lambda t, params: evaluator.predictions(theta0, params, heads[t], data[t])
  for i, a1 in enumerate(alphas):
    for j, a2 in enumerate(alphas):
      both = evaluator.edit(theta0, a1 * vectors[0] + a2 * vectors[1], 1.0)
      expected = sum(np.mean(predict(t, both) != predict(t, evaluator.edit(theta0, v, a)))
                     for t, (v, a) in enumerate(zip(vectors, (a1, a2))))
      np.testing.assert_allclose(xi[i, j], expected, rtol=0, atol=1e-6)
  assert xi[2, 2] == 0 and xi.max() > 0.2  # α = (0, 0) is θ0 itself; τ1 moves task 2
