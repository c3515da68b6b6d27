"""Each regime's defining property: what moves, and through which function."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import quickstart
from editing import regimes
from editing import sharding
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from editing.models import head as head_lib
from editing.models import vit
from editing.regimes import attention_only
from editing.regimes import talos

MODEL = vit.build(quickstart.get_config('tiny').model)
IMAGES = jax.random.uniform(jax.random.PRNGKey(1), (4, 32, 32, 3))
THETA0 = MODEL.init(jax.random.PRNGKey(0), IMAGES)['params']
APPLY = lambda params, images: MODEL.apply({'params': params}, images)


def direction(seed, scale=0.05):
  leaves, treedef = jax.tree.flatten(THETA0)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(treedef, [scale * jax.random.normal(k, x.shape)
                                      for k, x in zip(keys, leaves)])


def shifted(*terms):
  """θ0 + Σ coefficient · direction."""
  return jax.tree.map(lambda base, *ds: base + sum(ds), THETA0,
                      *[jax.tree.map(lambda d, c=c: c * d, d) for c, d in terms])


def test_unknown_regime_lists_the_known_ones():
  with pytest.raises(ValueError, match="unknown regime 'ntk'.*linearized"):
    regimes.get('ntk')


def test_linearized_model_equals_the_model_at_theta0():
  f_lin = regimes.get('linearized').encoder(APPLY)
  np.testing.assert_allclose(f_lin(THETA0, THETA0, IMAGES), APPLY(THETA0, IMAGES), rtol=1e-6,
                             atol=1e-6)


def test_linearized_model_is_affine_in_theta():
  f_lin = regimes.get('linearized').encoder(APPLY)
  u, v, a, b = direction(2), direction(3), 0.7, -1.3
  base = f_lin(THETA0, THETA0, IMAGES)
  combined = f_lin(THETA0, shifted((a, u), (b, v)), IMAGES) - base
  separate = (a * (f_lin(THETA0, shifted((1.0, u)), IMAGES) - base)
              + b * (f_lin(THETA0, shifted((1.0, v)), IMAGES) - base))
  np.testing.assert_allclose(combined, separate, rtol=1e-4, atol=1e-4)
  # The real model is not affine at this step size, so the check above can fail.
  nonlinear = APPLY(shifted((a, u), (b, v)), IMAGES) - APPLY(THETA0, IMAGES)
  nonlinear_separate = (a * (APPLY(shifted((1.0, u)), IMAGES) - APPLY(THETA0, IMAGES))
                        + b * (APPLY(shifted((1.0, v)), IMAGES) - APPLY(THETA0, IMAGES)))
  assert np.abs(nonlinear - nonlinear_separate).max() > 1e-2


def test_linearized_gradient_is_the_jacobian_at_theta0_wherever_theta_is():
  f_lin = regimes.get('linearized').encoder(APPLY)
  weights = jax.random.normal(jax.random.PRNGKey(4), (4, MODEL.embed_dim))
  objective = lambda params: jnp.sum(weights * f_lin(THETA0, params, IMAGES))
  at_theta0 = jax.grad(objective)(THETA0)
  elsewhere = jax.grad(objective)(shifted((1.0, direction(5, scale=0.5))))
  jacobian_t = jax.grad(lambda p: jnp.sum(weights * APPLY(p, IMAGES)))(THETA0)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), elsewhere,
               at_theta0)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), at_theta0,
               jacobian_t)


def test_attention_only_trains_exactly_the_four_projection_weights_of_every_block():
  trainable = regimes.get('attention_only').trainable(THETA0)
  chosen = sorted(p for p, t in trainable.items() if t)
  depth = quickstart.get_config('tiny').model.depth
  assert chosen == sorted(f'blocks_{i}/attn/{n}/kernel' for i in range(depth)
                          for n in ('query', 'key', 'value', 'out'))
  assert trainable['blocks_0/attn/query/bias'] is False
  assert all(regimes.get('full').trainable(THETA0).values())


def test_attention_only_optimizer_state_holds_only_attention_weights():
  regime = regimes.get('attention_only')
  head = jax.random.normal(jax.random.PRNGKey(1), (3, MODEL.embed_dim))
  prepared = train.prepare(
      quickstart.training(batch_size=4), params=THETA0, trainable=regime.trainable(THETA0),
      loss_fn=head_lib.frozen_head_loss(regime.encoder(APPLY), 30.0),
      consts={'theta0': THETA0, 'head': head}, mesh=sharding.make_mesh(1))
  state_leaves = [(p, x) for p, x in tree_lib.flatten(prepared.state.opt_state).items()
                  if np.ndim(x) > 0]
  assert state_leaves
  for path, _ in state_leaves:
    assert re.search(attention_only.ATTENTION_WEIGHTS, path), path
  optimizer_entries = sum(np.size(x) for _, x in state_leaves)
  attention_entries = sum(np.size(x) for p, x in tree_lib.flatten(THETA0).items()
                          if re.fullmatch(attention_only.ATTENTION_WEIGHTS, p))
  assert optimizer_entries == 2 * attention_entries  # Adam's two moments, nothing else


def test_attention_only_training_moves_the_attention_weights_and_nothing_else(tmp_path):
  regime = regimes.get('attention_only')
  task = suite.load_task('colour', seed=0, train_size=64, test_size=8)
  head = jax.random.normal(jax.random.PRNGKey(1), (task.num_classes, MODEL.embed_dim))
  trained = train.train(
      quickstart.training(steps=3, batch_size=16, warmup_steps=1, checkpoint_every=3),
      loss_fn=head_lib.frozen_head_loss(regime.encoder(APPLY), 30.0), params=THETA0,
      trainable=regime.trainable(THETA0), consts={'theta0': THETA0, 'head': head},
      data=task.train, workdir=str(tmp_path), mesh=sharding.make_mesh(1))
  before, after = tree_lib.flatten(THETA0), tree_lib.flatten(trained)
  for path, value in after.items():
    if re.fullmatch(attention_only.ATTENTION_WEIGHTS, path):
      assert not np.array_equal(value, before[path]), f'{path} did not move'
    else:
      np.testing.assert_array_equal(np.asarray(value).view(np.uint32),
                                    np.asarray(before[path]).view(np.uint32), err_msg=path)


HEAD = jax.random.normal(jax.random.PRNGKey(3), (5, MODEL.embed_dim))
LOGITS = lambda params, images: head_lib.logits(APPLY(params, images), HEAD, 30.0)
CALIBRATION = np.asarray(jax.random.uniform(jax.random.PRNGKey(4), (7, 32, 32, 3)))
TALOS_PATHS = sorted(p for p, t in regimes.get('talos').trainable(THETA0).items() if t)


def test_talos_eligible_leaves_exclude_the_input_independent_embeddings():
  assert 'class_embedding' not in TALOS_PATHS and 'position_embedding' not in TALOS_PATHS
  assert {'patch_embed/kernel', 'proj/kernel', 'ln_pre/scale', 'blocks_1/mlp_fc/bias',
          'blocks_0/attn/out/kernel', 'blocks_0/ln_2/bias'} <= set(TALOS_PATHS)
  assert len(TALOS_PATHS) == len(THETA0) - 2 + sum(
      len(tree_lib.flatten(v)) - 1 for k, v in THETA0.items() if isinstance(v, dict))


def test_talos_scores_match_a_slow_per_example_loop():
  key = jax.random.PRNGKey(5)
  fast = talos.sensitivity(LOGITS, THETA0, TALOS_PATHS, CALIBRATION, key, batch_size=3)
  slow = {p: np.zeros(np.shape(v)) for p, v in tree_lib.flatten(THETA0).items()
          if p in TALOS_PATHS}
  logits = jax.jit(LOGITS)
  logit_gradient = jax.jit(jax.grad(lambda params, x, label: LOGITS(params, x)[0, label]))
  for i in range(len(CALIBRATION)):
    x = CALIBRATION[i:i + 1]
    label = jax.random.categorical(jax.random.fold_in(key, i), logits(THETA0, x)[0])
    for p, g in tree_lib.flatten(logit_gradient(THETA0, x, label)).items():
      if p in slow:
        slow[p] += np.square(np.asarray(g, np.float64))
  assert fast.keys() == slow.keys()
  for p in slow:
    np.testing.assert_allclose(fast[p], slow[p], rtol=1e-4, atol=1e-10, err_msg=p)


def test_talos_keeps_exactly_round_k_n_of_the_lowest_scores():
  total = sum(np.size(tree_lib.flatten(THETA0)[p]) for p in TALOS_PATHS)
  masks = {(keep, rounds): talos.calibrate(LOGITS, THETA0, TALOS_PATHS, CALIBRATION,
                                           jax.random.PRNGKey(6), keep=keep, rounds=rounds,
                                           damping=0.1, batch_size=4)
           for keep, rounds in [(0.1, 4), (0.37, 1)]}
  for (keep, _), mask in masks.items():
    assert sorted(mask) == TALOS_PATHS
    assert sum(int(m.sum()) for m in mask.values()) == round(keep * total)
  # With one round, the kept entries are exactly the lowest-scoring ones of that round.
  mask = masks[(0.37, 1)]
  scores = talos.sensitivity(LOGITS, THETA0, TALOS_PATHS, CALIBRATION,
                             jax.random.fold_in(jax.random.PRNGKey(6), 1), batch_size=4)
  kept = np.concatenate([scores[p][mask[p]] for p in TALOS_PATHS])
  dropped = np.concatenate([scores[p][~mask[p]] for p in TALOS_PATHS])
  assert kept.max() <= dropped.min()


def lowest(scores: dict, count: int) -> dict:
  """{path: bool} True on the `count` lowest scores over every path, ties to the earlier
  (path-sorted, row-major) position, by a stable numpy sort."""
  flat = np.concatenate([scores[p].ravel() for p in TALOS_PATHS])
  chosen = np.zeros(flat.size, bool)
  chosen[np.argsort(flat, kind='stable')[:count]] = True
  sizes = np.cumsum([0] + [scores[p].size for p in TALOS_PATHS])
  return {p: chosen[a:b].reshape(scores[p].shape)
          for p, a, b in zip(TALOS_PATHS, sizes[:-1], sizes[1:])}


@pytest.mark.parametrize('damping', [0.1, 1.0])
def test_talos_rounds_score_the_network_with_dropped_entries_damped(damping):
  """The authors' damped iterative selection: round 2 scores θ0 with round 1's dropped
  entries multiplied by `damping`, those entries at +∞; damping 1 scores θ0 itself."""
  key, keep = jax.random.PRNGKey(8), 0.2
  flat = tree_lib.flatten(THETA0)
  total = sum(np.size(flat[p]) for p in TALOS_PATHS)
  first = lowest(talos.sensitivity(LOGITS, THETA0, TALOS_PATHS, CALIBRATION,
                                   jax.random.fold_in(key, 1), batch_size=4),
                 round(keep ** 0.5 * total))
  damped = {**flat, **{p: np.where(first[p], flat[p], damping * np.asarray(flat[p]))
                       for p in TALOS_PATHS}}
  scores = talos.sensitivity(LOGITS, tree_lib.unflatten(damped), TALOS_PATHS, CALIBRATION,
                             jax.random.fold_in(key, 2), batch_size=4)
  expected = lowest({p: np.where(first[p], scores[p], np.inf) for p in TALOS_PATHS},
                    round(keep * total))
  got = talos.calibrate(LOGITS, THETA0, TALOS_PATHS, CALIBRATION, key, keep=keep, rounds=2,
                        damping=damping, batch_size=4)
  for p in TALOS_PATHS:
    np.testing.assert_array_equal(got[p], expected[p], err_msg=p)
  if damping == 1.0:
    undamped_scores = talos.sensitivity(LOGITS, THETA0, TALOS_PATHS, CALIBRATION,
                                        jax.random.fold_in(key, 2), batch_size=4)
    for p in TALOS_PATHS:
      np.testing.assert_array_equal(scores[p], undamped_scores[p], err_msg=p)


def test_talos_breaks_ties_by_position():
  # Logits that read only the class embedding: every eligible entry scores 0, a full tie.
  flat_logits = lambda params, images: jnp.tile(params['class_embedding'][:5], (len(images), 1))
  mask = talos.calibrate(flat_logits, THETA0, TALOS_PATHS, CALIBRATION, jax.random.PRNGKey(0),
                         keep=0.1, rounds=2, damping=0.1, batch_size=4)
  flat = np.concatenate([mask[p].ravel() for p in TALOS_PATHS])
  count = int(flat.sum())
  assert flat[:count].all() and not flat[count:].any()


def test_talos_training_leaves_every_masked_out_entry_bit_identical(tmp_path):
  regime = regimes.get('talos', {'keep': 0.2, 'rounds': 2, 'batch_size': 4})
  task = suite.load_task('colour', seed=0, train_size=64, test_size=8)
  head = jax.random.normal(jax.random.PRNGKey(1), (task.num_classes, MODEL.embed_dim))
  logits_fn = lambda params, images: head_lib.logits(APPLY(params, images), head, 30.0)
  mask = regime.update_mask(THETA0, logits_fn=logits_fn, images=CALIBRATION,
                            key=jax.random.PRNGKey(0))
  trained = train.train(
      quickstart.training(steps=3, batch_size=16, warmup_steps=1, checkpoint_every=3),
      loss_fn=head_lib.frozen_head_loss(regime.encoder(APPLY), 30.0), params=THETA0,
      trainable=regime.trainable(THETA0), consts={'theta0': THETA0, 'head': head},
      data=task.train, workdir=str(tmp_path), mesh=sharding.make_mesh(1), update_mask=mask)
  before, after = tree_lib.flatten(THETA0), tree_lib.flatten(trained)
  moved = 0
  for path, value in after.items():
    value, base = np.asarray(value), np.asarray(before[path])
    outside = ~mask[path] if path in mask else np.ones(base.shape, bool)
    np.testing.assert_array_equal(value[outside].view(np.uint32), base[outside].view(np.uint32),
                                  err_msg=path)
    moved += int((value != base).sum())
  kept = sum(int(m.sum()) for m in mask.values())
  assert moved > 0.9 * kept, f'only {moved} of the {kept} kept entries moved'


def test_regime_settings_are_checked():
  assert regimes.get('talos', {'keep': 0.05}).keep == 0.05
  with pytest.raises(ValueError, match='talos.sparsity is not a setting'):
    regimes.get('talos', {'sparsity': 0.9})
  with pytest.raises(ValueError, match=r'^talos.keep = 1.5: must be a number in \(0, 1\]$'):
    regimes.get('talos', {'keep': 1.5})
