"""WEMoE and E-WEMoE: the routed model against a reference that makes each sample's MLP
weights W0 + Σ_t r_t τ_t block by block and runs the plain encoder on them, its defining
properties (constant routers are task arithmetic; only the routers train, lowering the
entropy; E-WEMoE's experts and shared router), and the merge job running it."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import merge as merge_config
from editing.errors import UserError
from editing.jobs import experiment
from editing.models import vit
from editing.task_vector import TaskVector
from editing.jobs import workdir as workdir_lib
from merging import common
from merging import wemoe
from merging.jobs import merge

TASKS = ('t0', 't1', 't2')


@pytest.fixture(scope='module', name='model')
def model_fixture():
  module = vit.VisionTransformer(patch_size=4, width=8, depth=2, num_heads=2, mlp_dim=16,
                                 embed_dim=None)
  images = jax.random.uniform(jax.random.PRNGKey(1), (3, 8, 8, 3))
  theta0 = module.init(jax.random.PRNGKey(0), images[:1])['params']
  rng = np.random.default_rng(0)
  vectors = [TaskVector(jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape),
                                                           jnp.float32), theta0),
                        (t,), 'full', 'base') for t in TASKS]
  apply_fn = lambda params, x: module.apply({'params': params}, x)
  return module, apply_fn, theta0, vectors, images


def numpy_router(router: dict, h: np.ndarray) -> np.ndarray:
  """The authors' router on one sample's tokens h (n, d), averaged over the tokens."""
  router = {k: np.asarray(v, np.float64) for k, v in router.items()}
  if 'w1' in router:
    out = np.maximum(h @ router['w1'] + router['b1'], 0) @ router['w2'] + router['b2']
  elif 'w' in router:
    out = h @ router['w'] + router['b']
  else:
    return router['b']
  return out.mean(axis=0)


def per_sample_reference(module, upscaled: wemoe.Upscaled, image) -> np.ndarray:
  """One sample through the plain encoder, its MLP weights made block by block: block i's
  routing reads the MLP input that the blocks before it, already made, give."""
  params = jax.tree.map(np.asarray, upscaled.params)
  for block, layers in upscaled.experts.items():
    _, state = module.apply({'params': params}, image[None], capture_intermediates=True)
    h = np.asarray(state['intermediates'][block]['ln_2']['__call__'][0][0], np.float64)
    router = upscaled.routers.get(block, upscaled.routers.get(wemoe.SHARED))
    r = numpy_router(router, h)
    for layer, expert in layers.items():
      for leaf in ('kernel', 'bias'):
        tau = np.asarray(expert[leaf], np.float64)
        params[block][layer][leaf] = (np.asarray(params[block][layer][leaf], np.float64)
                                      + np.tensordot(r, tau, axes=1)).astype(np.float32)
  return np.asarray(module.apply({'params': params}, image[None]))[0]


@pytest.mark.parametrize('depth', ['2', '1', '0'])
def test_the_routed_model_equals_each_samples_own_merged_weights(model, depth):
  module, apply_fn, theta0, vectors, images = model
  upscaled = wemoe.upscale(vectors, theta0, jax.random.PRNGKey(2), init_lambda=0.3,
                           router_depth=depth)
  # Routers far from their initialisation, so that samples and blocks route differently.
  rng = np.random.default_rng(depth.__hash__() % 7)
  upscaled = upscaled._replace(routers=jax.tree.map(
      lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), upscaled.routers))
  got = np.asarray(wemoe.routed(upscaled, apply_fn, images))
  for b in range(len(images)):
    np.testing.assert_allclose(got[b], per_sample_reference(module, upscaled, images[b]),
                               rtol=2e-4, atol=2e-5)


def test_constant_routers_are_task_arithmetic(model):
  _, apply_fn, theta0, vectors, images = model
  upscaled = wemoe.upscale(vectors, theta0, jax.random.PRNGKey(3), init_lambda=0.4,
                           router_depth='2')
  flat_routers = {b: {k: jnp.zeros_like(x) if k != 'b2' else x for k, x in r.items()}
                  for b, r in upscaled.routers.items()}
  got = wemoe.routed(upscaled._replace(routers=flat_routers), apply_fn, images)
  merged = sum(vectors[1:], vectors[0]).apply_to(theta0, 0.4)
  np.testing.assert_allclose(got, apply_fn(merged, images), rtol=1e-4, atol=1e-5)


def test_only_the_routers_train_and_the_entropy_falls(model):
  _, apply_fn, theta0, vectors, _ = model
  heads = jax.random.normal(jax.random.PRNGKey(4), (len(TASKS), 5, 8))
  rng = np.random.default_rng(5)
  data = {t: common.TaskData(lambda p, x, k=k: apply_fn(p, x) @ heads[k].T,
                             rng.uniform(size=(32, 8, 8, 3)).astype(np.float32))
          for k, t in enumerate(TASKS)}
  before = wemoe.upscale(vectors, theta0, jax.random.PRNGKey(6), init_lambda=0.3,
                         router_depth='2')
  learned = wemoe.learn(before, data, jax.random.PRNGKey(7), steps=30, learning_rate=1e-2,
                        batch_size=8)
  assert np.mean(learned.entropies[-5:]) < learned.entropies[0] - 0.05, learned.entropies
  for a, b in zip(jax.tree.leaves((before.params, before.experts)),
                  jax.tree.leaves((learned.model.params, learned.model.experts))):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before.routers),
                                                     jax.tree.leaves(learned.model.routers)))


def test_efficient_wemoe_keeps_each_tensors_largest_entries_and_shares_one_router(model):
  _, _, theta0, vectors, _ = model
  upscaled = wemoe.upscale(vectors, theta0, jax.random.PRNGKey(8), init_lambda=0.3,
                           router_depth='2', density=0.1, shared=True)
  assert list(upscaled.routers) == [wemoe.SHARED]
  for block, layers in upscaled.experts.items():
    for layer, expert in layers.items():
      for leaf, stacked in expert.items():
        for k, vector in enumerate(vectors):
          tau = np.asarray(vector.delta[block][layer][leaf]).ravel()
          keep = max(1, int(0.1 * tau.size))
          want = np.zeros_like(tau)
          top = np.argsort(-np.abs(tau), kind='stable')[:keep]
          want[top] = tau[top]
          np.testing.assert_array_equal(np.asarray(stacked[k]).ravel(), want)


def test_params_without_the_encoders_mlps_are_refused_by_name():
  theta0 = {'layers_0': {'mlp': {'gate_proj': {'kernel': jnp.zeros((4, 4))}}}}
  vectors = [TaskVector(theta0, (t,), 'full', 'base') for t in TASKS]
  with pytest.raises(UserError, match=r"wemoe upscales the MLP layers \('mlp_fc', 'mlp_proj'\)"):
    wemoe.upscale(vectors, theta0, jax.random.PRNGKey(0), init_lambda=0.3, router_depth='2')


def test_the_merge_job_scores_the_routed_model_and_counts_its_bytes(tiny_run):
  config, workdir, _ = tiny_run
  config = merge_config.get_config('tiny')
  config.merge.methods = 'wemoe'
  config.regimes = 'full'
  config.wemoe.steps = 3
  summary = merge.run(config, workdir)['full']
  theta0, apply_fn = experiment.load_pretrained(workdir)
  tasks = experiment.tasks(config)
  evaluator = experiment.evaluator(config, apply_fn, 'full')
  scorer = evaluator.with_encoder(wemoe.encoder(evaluator.encoder))
  data = {t: experiment.load_task(config, t) for t in tasks}
  heads = {t: experiment.head(config, workdir, data[t], theta0, apply_fn) for t in tasks}
  directory = workdir_lib.merge_dir(workdir, 'full')
  result = summary['methods']['wemoe']
  with ocp.StandardCheckpointer() as checkpointer:
    saved = wemoe.Upscaled(**checkpointer.restore(
        os.path.abspath(os.path.join(directory, 'wemoe', 'params'))))
  test = scorer.accuracies(theta0, saved, {t: (heads[t], data[t].test) for t in tasks})
  assert result['test'] == test
  # Every leaf outside the MLPs moves under full fine-tuning; the MLPs' are the experts, one
  # float32 copy a task.
  mlp = sum(x.size for b in saved.experts for layer in saved.experts[b].values()
            for x in jax.tree.leaves(layer)) // len(tasks)
  outside = sum(x.size for x in jax.tree.leaves(theta0)) - mlp
  routers = sum(x.size for x in jax.tree.leaves(saved.routers))
  assert result['bytes_beyond_theta0'] == 4 * outside + 4 * len(tasks) * mlp + 4 * routers
  # Each MLP runs T + 1 matmuls, and the routers read every token.
  assert result['inference_flops'] > 1, result['inference_flops']
