"""WEMoE and E-WEMoE: the MLPs upscaled to a weight-ensembling mixture of the task vectors,
routed per sample by routers trained at test time.

Tang et al., "Merging Multi-Task Models via Weight-Ensembling Mixture of Experts", ICML 2024;
Shen, Tang et al., "Efficient and Effective Weight-Ensembling Mixture of Experts for Multi-Task
Model Merging" (E-WEMoE), 2024. Every weight outside the MLPs is task arithmetic's,
θ0 + λ0·Σ_t τ_t (λ0 = `init_lambda`); in every block, each of the MLP's two dense layers
takes, for an input x,

  W(x) = W0 + Σ_t r_t(x)·τ_t^W,     b(x) = b0 + Σ_t r_t(x)·τ_t^b,

with r(x) ∈ R^T the block's router read on the MLP's inputs h_n and averaged over x's tokens,

  r(x) = mean_n W2·ReLU(W1·h_n + b1) + b2      (depth 2; depth 1: W·h_n + b; depth 0: b),

with no softmax and no normalisation. Routers start at weights N(0, 0.01²), b1 = 0 and the
last bias λ0, so each r_t starts near λ0 and the model near task arithmetic's. Only the
routers train, by Adam on AdaMerging's objective,

  Σ_t E_{x∼X_t} H(softmax f_t(x)),

the entropy of each task's unlabeled test inputs under its own head.

E-WEMoE keeps each MLP task vector's largest magnitudes, a `density` share of every tensor
(biases too), and one router shared by every block.

The model is not a merged pytree: `routed` runs any function of the params (an encoder, a
logits function) with its MLPs routed, computing each MLP layer as
x·W0 + b0 + Σ_t r_t·(x·τ_t^W + τ_t^b). That equals x·W(x) + b(x) without a weight matrix per
sample; it costs T + 1 matmuls a layer in place of one. Routing is per sample in training as
in evaluation, as the WEMoE authors' code has it (FusionBench trains with one routing per
batch).

The routers read the mean of a sample's tokens, which a causal decoder has only once it has
read the whole sample: the image encoder's MLPs (editing.models.vit.Block) are the ones
upscaled.
"""

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from editing import settings
from editing import tree as tree_lib
from editing.errors import UserError
from editing.progress import Progress
from editing.task_vector import TaskVector, check_compatible
from merging import adamerging
from merging import common
from merging import ops

PyTree = Any
# The image encoder's MLP layers (editing.models.vit.Block): the first reads the MLP's input,
# which the routers read too.
MLP = ('mlp_fc', 'mlp_proj')
# The key of E-WEMoE's one router, which every block reads.
SHARED = '*'
ROUTER_DEPTHS = ('0', '1', '2')

SETTINGS = dict(
    init_lambda=settings.number(0.3, '(-inf, inf)', "task arithmetic's λ outside the MLPs, "
                                                    "and each router's initial output"),
    router_depth=settings.choice('2', ROUTER_DEPTHS, "the routers' layers: 2, d→d→T with a "
                                                     'ReLU; 1, d→T; 0, a learned constant'),
    steps=settings.integer(1000, '[0, inf)', 'Adam steps on the entropy of unlabeled test '
                                              'inputs'),
    learning_rate=settings.number(1e-4, '(0, inf)', "Adam's learning rate for the routers"),
    batch_size=settings.integer(16, '[1, inf)', 'unlabeled inputs per task and step'))
EFFICIENT_SETTINGS = dict(
    SETTINGS, density=settings.number(0.1, '(0, 1]', 'the share of each MLP tensor of each '
                                                     'task vector kept, by magnitude'))


class Upscaled(NamedTuple):
  """A WEMoE model: what `routed` runs."""

  params: PyTree  # θ0 + λ0·Σ_t τ_t outside the MLPs, θ0 in them
  experts: dict  # {block: {layer: {'kernel': (T, in, out), 'bias': (T, out)}}}: the τ_t
  routers: dict  # {block: router}, or {SHARED: router}


class Learned(NamedTuple):
  model: Upscaled
  entropies: list[float]  # the objective at each step, before its update


def upscale(task_vectors: Sequence[TaskVector], theta0: PyTree, key: jax.Array, *,
            init_lambda: float, router_depth: str, density: float = 1.0, shared: bool = False,
            method: str = 'wemoe') -> Upscaled:
  """The model before its routers train: every r_t near `init_lambda`."""
  check_compatible(task_vectors, method)
  if task_vectors[0].low_rank:
    raise UserError(f'{method} routes dense task vectors; materialize the LoRA vectors first '
                    '(TaskVector.materialized)')
  if router_depth not in ROUTER_DEPTHS:
    raise UserError(f'{method}: router_depth must be one of {ROUTER_DEPTHS}, got '
                    f'{router_depth!r}')
  flat0 = tree_lib.flatten(theta0)
  blocks = list(dict.fromkeys(_block(p) for p in flat0 if _layer(p) in MLP))
  if not blocks:
    raise UserError(f'{method} upscales the MLP layers {MLP} of an image encoder\'s blocks, and '
                    'these params have none (a decoder\'s are not routed: a router reads the '
                    'mean of a sample\'s tokens, which a causal decoder has only at its end)')
  deltas = [tree_lib.flatten(v.delta) for v in task_vectors]
  if density < 1:
    mlps = [_mlp_only(d) for d in deltas]
    deltas = [ops.where(ops.keep_largest(m, density, 'tensor'), m) for m in mlps]
  experts = {b: {layer: {leaf: jnp.stack([d[f'{b}/{layer}/{leaf}'] for d in deltas])
                         for leaf in ('kernel', 'bias')}
                 for layer in MLP}
             for b in blocks}
  merged = sum(task_vectors[1:], task_vectors[0]).apply_to(theta0, init_lambda)
  params = tree_lib.map_with_path(lambda p, m, t: t if _layer(p) in MLP else m, merged, theta0)
  width = flat0[f'{blocks[0]}/{MLP[0]}/kernel'].shape[0]
  make = lambda k: _router(k, width, len(task_vectors), int(router_depth), init_lambda)
  routers = ({SHARED: make(key)} if shared else
             {b: make(jax.random.fold_in(key, i)) for i, b in enumerate(blocks)})
  return Upscaled(params, experts, routers)


def _block(path: str) -> str:
  return path.rsplit('/', 2)[0]


def _layer(path: str) -> str | None:
  parts = path.split('/')
  return parts[-2] if len(parts) >= 2 else None


def _mlp_only(delta: dict) -> dict:
  """{path: leaf} of the MLP leaves of a flat delta."""
  return {p: x for p, x in delta.items() if _layer(p) in MLP}


def _router(key: jax.Array, width: int, experts: int, depth: int, init: float) -> dict:
  """Weights N(0, 0.01²), hidden bias 0, output bias `init` (the authors' initialisation)."""
  k1, k2 = jax.random.split(key)
  normal = lambda k, shape: 0.01 * jax.random.normal(k, shape, jnp.float32)
  out_bias = jnp.full((experts,), init, jnp.float32)
  if depth == 2:
    return {'w1': normal(k1, (width, width)), 'b1': jnp.zeros((width,), jnp.float32),
            'w2': normal(k2, (width, experts)), 'b2': out_bias}
  if depth == 1:
    return {'w': normal(k1, (width, experts)), 'b': out_bias}
  return {'b': out_bias}


def route(router: dict, h: jax.Array) -> jax.Array:
  """r(x): (batch, T) from the MLP's inputs h (batch, ..., d), averaged over the tokens."""
  if 'w1' in router:
    out = jax.nn.relu(h @ router['w1'] + router['b1']) @ router['w2'] + router['b2']
  elif 'w' in router:
    out = h @ router['w'] + router['b']
  else:
    return jnp.broadcast_to(router['b'], (h.shape[0],) + router['b'].shape)
  return jnp.mean(out, axis=tuple(range(1, out.ndim - 1)))


def routed(model: Upscaled, fn: Callable, *args) -> Any:
  """fn(model.params, *args), with every upscaled MLP layer computed as
  x·W0 + b0 + Σ_t r_t(x)·(x·τ_t^W + τ_t^b)."""
  weights = {}

  def intercept(next_fun, call_args, call_kwargs, context):
    module = context.module
    path = module.path
    block = '/'.join(path[:-1])
    if (context.method_name != '__call__' or not isinstance(module, nn.Dense)
        or not path or path[-1] not in MLP or block not in model.experts):
      return next_fun(*call_args, **call_kwargs)
    x = call_args[0]
    if path[-1] == MLP[0]:
      weights[block] = route(model.routers.get(block, model.routers.get(SHARED)), x)
    r, expert = weights[block], model.experts[block][path[-1]]
    tokens = (slice(None),) + (None,) * (x.ndim - 2)
    return (next_fun(*call_args, **call_kwargs)
            + jnp.einsum('bt,b...i,tio->b...o', r, x, expert['kernel'])
            + (r @ expert['bias'])[tokens])

  with nn.intercept_methods(intercept):
    return fn(model.params, *args)


def encoder(encoder_fn: Callable) -> Callable:
  """The encoder(θ0, model, inputs) of an `Upscaled` model, from a regime's
  encoder(θ0, params, inputs)."""
  return lambda theta0, model, inputs: routed(
      model, lambda params, x: encoder_fn(theta0, params, x), inputs)


def learn(model: Upscaled, data: Mapping[str, common.TaskData], key: jax.Array, *, steps: int,
          learning_rate: float, batch_size: int) -> Learned:
  """The routers fitted by Adam on the summed entropy of each task's unlabeled inputs under
  its own head (`data[t].logits_fn`); nothing else trains."""
  tx = optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate)
  logits_fns = [d.logits_fn for d in data.values()]

  def step(routers, opt_state, batches, frozen):
    def objective(routers):
      upscaled = frozen._replace(routers=routers)
      return sum(adamerging.entropy(routed(upscaled, f, b)) for f, b in zip(logits_fns, batches))

    value, grads = jax.value_and_grad(objective)(routers)
    updates, opt_state = tx.update(grads, opt_state, routers)
    return optax.apply_updates(routers, updates), opt_state, value

  routers, opt_state = model.routers, tx.init(model.routers)
  step = adamerging.compiled_once(step, routers, opt_state,
                                  [d.images[:batch_size] for d in data.values()], model)
  entropies = []
  progress = Progress('router training', steps, unit='steps')
  for i in range(steps):
    batches = list(adamerging.step_batches(data, batch_size, key, i).values())
    routers, opt_state, value = step(routers, opt_state, batches, model)
    entropies.append(float(value))
    progress.advance()
  return Learned(model._replace(routers=routers), entropies)


def _tasks(task_vectors: Sequence[TaskVector], data: Mapping[str, common.TaskData],
           method: str) -> dict[str, common.TaskData]:
  return {t: common.task_of(v, data, method) for v in task_vectors for t in v.tasks}


@settings.declare(**SETTINGS)
def merge(task_vectors: Sequence[TaskVector], *, theta0: PyTree,
          data: Mapping[str, common.TaskData], key: jax.Array, init_lambda: float,
          router_depth: str, steps: int, learning_rate: float, batch_size: int) -> Upscaled:
  """WEMoE: every block's MLP upscaled over the dense task vectors, a router each."""
  init_key, learn_key = jax.random.split(key)
  model = upscale(task_vectors, theta0, init_key, init_lambda=init_lambda,
                  router_depth=router_depth)
  return learn(model, _tasks(task_vectors, data, 'wemoe'), learn_key, steps=steps,
               learning_rate=learning_rate, batch_size=batch_size).model


@settings.declare(**EFFICIENT_SETTINGS)
def merge_efficient(task_vectors: Sequence[TaskVector], *, theta0: PyTree,
                    data: Mapping[str, common.TaskData], key: jax.Array, init_lambda: float,
                    router_depth: str, steps: int, learning_rate: float, batch_size: int,
                    density: float) -> Upscaled:
  """E-WEMoE: the MLP task vectors pruned to `density` per tensor, one router for every
  block."""
  init_key, learn_key = jax.random.split(key)
  model = upscale(task_vectors, theta0, init_key, init_lambda=init_lambda,
                  router_depth=router_depth, density=density, shared=True, method='e_wemoe')
  return learn(model, _tasks(task_vectors, data, 'e_wemoe'), learn_key, steps=steps,
               learning_rate=learning_rate, batch_size=batch_size).model


def stored_bytes(model: Upscaled, theta0: PyTree) -> int:
  """Bytes beyond θ0, float32: the leaves the merge changes outside the MLPs, whole; each
  expert tensor dense, or its nonzero entries with an int32 index each where that is
  smaller; the routers."""
  changed = sum(4 * a.size for a, b in zip(jax.tree.leaves(model.params),
                                           jax.tree.leaves(theta0))
                if np.any(np.asarray(a) != np.asarray(b)))
  experts = sum(min(4 * leaf.size, 8 * int(np.count_nonzero(np.asarray(leaf))))
                for leaf in jax.tree.leaves(model.experts))
  return changed + experts + 4 * tree_lib.num_params(model.routers)
