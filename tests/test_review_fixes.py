"""Review fixes without a test file of their own: an unknown model family is named; AdaMerging
compiles one step for every merge of the same shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from editing.errors import UserError
from editing.models import hf
from editing.task_vector import TaskVector
from merging import adamerging
from merging import common


@pytest.mark.parametrize('use', [
    lambda family: hf.load('/nonexistent', family),
    lambda family: hf.export('/nonexistent', {}, {'depth': 1}, family)], ids=['load', 'export'])
def test_an_unknown_model_family_is_named_with_the_known_ones(use):
  with pytest.raises(UserError, match=r"unknown model family 'clip'; known: \[.*'clip_vision'"):
    use('clip')


def adamerging_problem(seed):
  """Two single-task vectors on a linear model, each task's logits_fn a new closure over a new
  head, as the merge job builds them for every merge."""
  rng = np.random.default_rng(seed)
  theta0 = {'w': jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
  vectors, data = [], {}
  for task in ('a', 'b'):
    vectors.append(TaskVector({'w': jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)},
                              (task,), 'full', 'base'))
    head = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    data[task] = common.TaskData(lambda params, x, head=head: (x @ params['w']) @ head,
                                 rng.normal(size=(20, 4)).astype(np.float32))
  return vectors, theta0, data


def test_adamerging_compiles_one_step_for_every_merge_of_the_same_shapes():
  def learn(seed, learning_rate):
    vectors, theta0, data = adamerging_problem(seed)
    return adamerging.learn(vectors, theta0=theta0, data=data, key=jax.random.PRNGKey(seed),
                            granularity='layer', steps=3, learning_rate=learning_rate, init=0.3,
                            batch_size=8).coefficients['w']

  compiles = []

  def listen(event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      compiles.append(event)

  learn(0, 1e-2)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    # Other vectors, heads, data and learning rate, the same shapes: nothing to compile.
    shared = learn(1, 5e-2)
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert not compiles, f'{len(compiles)} programs compiled for a merge of the same shapes'
  # The shared program reads this merge's heads, not the first one's: the same coefficients
  # as a program compiled for this merge alone.
  adamerging._compile.cache_clear()  # pylint: disable=protected-access
  np.testing.assert_array_equal(shared, learn(1, 5e-2))
