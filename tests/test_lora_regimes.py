"""LoRA and L-LoRA: PEFT's initialisation, what trains, the weights the factors make, and the
task vector's algebra on factors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import quickstart
from editing import checkpoint
from editing import lora
from editing import regimes
from editing import sharding
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from editing.errors import UserError
from editing.models import head as head_lib
from editing.models import keymap
from editing.models import vit
from editing.task_vector import TaskVector

MODEL = vit.build(quickstart.get_config('tiny').model)
IMAGES = jax.random.uniform(jax.random.PRNGKey(1), (4, 32, 32, 3))
THETA0 = MODEL.init(jax.random.PRNGKey(0), IMAGES)['params']
APPLY = lambda params, images: MODEL.apply({'params': params}, images)
ALL_ATTENTION = r'(.*/)?attn/(query|key|value|out)/kernel'


def random_factors(regime, seed):
  """Adapter factors with B away from zero, as after training."""
  initial = regime.initial(THETA0, jax.random.PRNGKey(seed))
  keys = iter(jax.random.split(jax.random.PRNGKey(seed + 100), 64))
  return jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), initial)


def test_factors_start_as_peft_initialises_them():
  regime = regimes.get('lora', {'rank': 4, 'targets': ALL_ATTENTION})
  flat = tree_lib.flatten(regime.initial(THETA0, jax.random.PRNGKey(0)))
  targeted = [p for p in tree_lib.flatten(THETA0) if re.fullmatch(ALL_ATTENTION, p)]
  assert sorted(flat) == sorted([f'{p}/a' for p in targeted] + [f'{p}/b' for p in targeted])
  inputs = MODEL.width  # every projection here reads a width-wide (or heads·dim-wide) input
  for path, value in flat.items():
    if path.endswith('/b'):
      assert value.shape == (inputs, 4) and not np.any(value), path
    else:
      # kaiming_uniform(a=√5) on an (r, inputs) weight: U(−1/√inputs, 1/√inputs).
      assert value.shape == (4, inputs), path
      bound = 1 / np.sqrt(inputs)
      assert np.abs(value).max() <= bound and np.abs(value).max() > 0.8 * bound, path


def test_scale_is_alpha_over_r_or_over_its_root_with_rslora():
  assert regimes.get('lora', {'rank': 4, 'alpha': 8.0}).scale == 2.0
  assert regimes.get('lora', {'rank': 4, 'alpha': 8.0, 'rslora': True}).scale == 4.0


def test_weights_are_theta0_plus_scaled_BA_in_peft_layout():
  """θ0 + s·B A, read through the Hugging Face key map's layouts: PEFT's ΔW (out, in) is a
  PyTorch weight, which the import maps onto our kernels."""
  regime = regimes.get('lora', {'rank': 3, 'alpha': 5.0, 'targets': ALL_ATTENTION})
  factors = tree_lib.flatten(random_factors(regime, 1))
  weights = tree_lib.flatten(regime.weights(THETA0, tree_lib.unflatten(factors)))
  for path, base in tree_lib.flatten(THETA0).items():
    if not re.fullmatch(ALL_ATTENTION, path):
      np.testing.assert_array_equal(weights[path], base, err_msg=path)
      continue
    theirs = (5.0 / 3) * np.asarray(factors[f'{path}/b']) @ np.asarray(factors[f'{path}/a'])
    layout = 'heads_out' if '/out/' in path else 'heads_in'
    expected = np.asarray(base) + keymap._to_ours(layout, theirs, MODEL.num_heads)
    np.testing.assert_allclose(weights[path], expected, rtol=1e-5, atol=1e-6, err_msg=path)


def test_l_lora_is_the_first_order_model_in_the_adapter_parameters():
  """f(p0) + J_p f(p0)·(p − p0), with A moved too: A's change is invisible (B0 = 0), so the
  regime that trains B alone and reads the linearized model computes exactly this."""
  regime = regimes.get('l_lora', {'rank': 4})
  lora_model = regimes.get('lora', {'rank': 4})
  p0 = regime.initial(THETA0, jax.random.PRNGKey(0))
  p = random_factors(regime, 0)
  f = lambda factors: lora_model.training_encoder(APPLY)(THETA0, factors, IMAGES)
  out0, dout = jax.jvp(f, (p0,), (jax.tree.map(jnp.subtract, p, p0),))
  reference = out0 + dout
  trained_b = tree_lib.unflatten({k: (v if k.endswith('/b') else tree_lib.flatten(p0)[k])
                                  for k, v in tree_lib.flatten(p).items()})
  ours = regime.training_encoder(APPLY)(THETA0, trained_b, IMAGES)
  np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-5)
  # The LoRA model itself is not linear in its factors at this size.
  assert np.abs(f(p) - reference).max() > 1e-2


@pytest.mark.parametrize('name, trained_suffixes', [('lora', ('/a', '/b')), ('l_lora', ('/b',))])
def test_only_the_factors_train_and_hold_optimizer_state(tmp_path, name, trained_suffixes):
  regime = regimes.get(name, {'rank': 2})
  task = suite.load_task('colour', seed=0, train_size=32, test_size=8)
  head = jax.random.normal(jax.random.PRNGKey(1), (task.num_classes, MODEL.embed_dim))
  initial = regime.initial(THETA0, jax.random.PRNGKey(0))
  config = quickstart.training(steps=2, batch_size=16, warmup_steps=1, checkpoint_every=2,
                               learning_rate=1e-2)
  loss_fn = head_lib.frozen_head_loss(regime.training_encoder(APPLY), 30.0)
  prepared = train.prepare(config, loss_fn=loss_fn, params=initial,
                           trainable=regime.trainable(initial),
                           consts={'theta0': THETA0, 'head': head}, mesh=sharding.make_mesh(1))
  moments = sum(np.size(x) for x in jax.tree.leaves(prepared.state.opt_state) if np.ndim(x))
  trained_entries = sum(np.size(v) for p, v in tree_lib.flatten(initial).items()
                        if p.endswith(trained_suffixes))
  assert moments == 2 * trained_entries  # Adam's two moments of the trained factors alone
  trained = train.train(config, loss_fn=loss_fn, params=initial,
                        trainable=regime.trainable(initial),
                        consts={'theta0': THETA0, 'head': head}, data=task.train,
                        workdir=str(tmp_path), mesh=sharding.make_mesh(1))
  for path, value in tree_lib.flatten(trained).items():
    moved = not np.array_equal(value, tree_lib.flatten(initial)[path])
    assert moved == path.endswith(trained_suffixes), path
  vector = regime.task_vector(THETA0, trained, task='colour')
  assert vector.low_rank and vector.regime == name
  np.testing.assert_allclose(
      regime.encoder(APPLY)(THETA0, vector.apply_to(THETA0), IMAGES),
      regime.training_encoder(APPLY)(THETA0, trained, IMAGES), rtol=1e-5, atol=1e-6)


def vectors(rank=3):
  regime = regimes.get('lora', {'rank': rank})
  return [regime.task_vector(THETA0, random_factors(regime, s), task=t)
          for s, t in ((1, 'a'), (2, 'b'))]


def dense(vector):
  return tree_lib.flatten(vector.materialized(THETA0).delta)


def test_algebra_on_factors_equals_the_algebra_of_the_dense_deltas():
  tau1, tau2 = vectors()
  d1, d2 = dense(tau1), dense(tau2)
  for combined, expected in ((tau1 + tau2, lambda p: d1[p] + d2[p]),
                             (tau1 - tau2, lambda p: d1[p] - d2[p]),
                             (0.3 * tau1 + -1.7 * tau2, lambda p: 0.3 * d1[p] - 1.7 * d2[p]),
                             (sum([tau1, tau2]), lambda p: d1[p] + d2[p])):
    assert combined.low_rank
    for path, value in dense(combined).items():
      np.testing.assert_allclose(value, expected(path), rtol=1e-5, atol=1e-6, err_msg=path)
  summed = tau1 + tau2
  assert {d.rank for d in summed.delta.values()} == {6}  # ranks stack
  negated = -tau1
  for path, factors in negated.delta.items():  # negation moves the scale, not the factors
    np.testing.assert_array_equal(factors.a, tau1.delta[path].a)
    np.testing.assert_array_equal(factors.b, tau1.delta[path].b)
  np.testing.assert_allclose(tau1.norm(), np.sqrt(sum(np.sum(v ** 2) for v in d1.values())),
                             rtol=1e-5)
  np.testing.assert_allclose(tau1.dot(tau2), sum(np.vdot(d1[p], d2[p]) for p in d1), rtol=1e-4)


def test_unadapted_leaves_materialize_as_zeros_and_apply_as_theta0():
  tau, _ = vectors()
  flat = dense(tau)
  applied = tree_lib.flatten(tau.apply_to(THETA0, 0.5))
  for path, base in tree_lib.flatten(THETA0).items():
    if path in tau.delta:
      np.testing.assert_allclose(applied[path], base + 0.5 * flat[path], rtol=1e-6, atol=1e-7)
    else:
      assert not np.any(flat[path]), path
      np.testing.assert_array_equal(applied[path], base, err_msg=path)


def test_saved_lora_vector_loads_bit_identical(tmp_path):
  tau, _ = vectors()
  tau = 0.5 * tau
  path = str(tmp_path / 'tv.safetensors')
  checkpoint.save_task_vector(path, tau)
  loaded, meta = checkpoint.load_task_vector(path)
  assert loaded.low_rank and (loaded.tasks, loaded.regime, loaded.base) == (
      tau.tasks, tau.regime, tau.base)
  assert meta['low_rank'] == {p: list(d.shape) for p, d in tau.delta.items()}
  for p, d in tau.delta.items():
    for field in ('a', 'b', 'scale'):
      np.testing.assert_array_equal(getattr(loaded.delta[p], field), getattr(d, field))


def test_bad_lora_input_is_named():
  with pytest.raises(UserError, match=r"lora.targets = 'mlp/kernel' matches no leaf"):
    regimes.get('lora', {'targets': 'mlp/kernel'}).initial(THETA0, jax.random.PRNGKey(0))
  with pytest.raises(UserError, match=r'lora.rank = 64 exceeds the 32 × 32 matrix of '
                                      r'blocks_0/attn/query/kernel'):
    regimes.get('lora', {'rank': 64}).initial(THETA0, jax.random.PRNGKey(0))
  with pytest.raises(UserError, match=r'^lora.rank = 0: must be an integer in \[1, inf\)$'):
    regimes.get('lora', {'rank': 0})
  tau, _ = vectors()
  full = TaskVector.from_params(THETA0, THETA0, task='b', regime='lora')
  with pytest.raises(UserError, match='mix LoRA factors with a dense delta; materialize'):
    tau + full
  other_targets = regimes.get('lora', {'rank': 3, 'targets': ALL_ATTENTION})
  wider = other_targets.task_vector(THETA0, random_factors(other_targets, 3), task='c')
  with pytest.raises(UserError, match='adapt different kernels'):
    tau + wider
  assert lora.matrix_shape('blocks_0/attn/out/kernel', (2, 16, 32)) == (32, 32)
  with pytest.raises(UserError, match='4-D'):
    lora.matrix_shape('patch_embed/kernel', (4, 4, 3, 32))
