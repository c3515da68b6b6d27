r"""DAM: defense-aware merging with two meta-learned masks, from unlabeled inputs only.

Yang et al., "Mitigating the Backdoor Effect for Multi-Task Model Merging via Safety-Aware
Subspace", ICLR 2025. Two per-entry masks over the whole backbone, shared by every task,

  θ(λ, M_s, M_b) = θ0 + Σ_k λ_k (M_s ⊙ M_b ⊙ τ_k)       (λ_k per task, or per task and leaf),

each mask a logit per entry relaxed by a binary Concrete sample and rescaled per tensor by its
mean, M = m / mean(m) with m = σ((ℓ + log u − log(1 − u)) / T), u ~ U(0, 1):

- the task-shared mask M_s keeps what serves every task: with the merged model's prediction
  entropy L_perf = Σ_t E_{x∼X_t} H(f_t(x; θ)) as objective, each step takes an inner Adam
  step on λ (AdaMerging's), then a first-order outer step on ℓ_s through θ(λ', ·);
- the backdoor-detection mask M_b drops what reacts to triggers: per task a universal
  perturbation δ_t, ‖δ_t‖_∞ ≤ ε, is pushed (one signed-gradient step per iteration, merged
  weights held fixed) to change the merged model's own predictions ŷ_t = argmax f_t(x; θ);
  ℓ_b then takes a step on L_perf + α Σ_t CE(f_t(x + δ_t; θ), ŷ_t), keeping predictions
  unchanged under the surrogate trigger.

The two mask steps alternate within every iteration. At the end each mask is made
deterministic by its expectation σ(ℓ) (the mean of the binary mask that the Concrete relaxes
as T → 0), rescaled per tensor by its mean as during training, and λ is fitted again from its
initial value by AdaMerging on the masked vectors M_s ⊙ M_b ⊙ τ_k. (A threshold 1[ℓ ≥ 0]
would turn the sign of every barely trained logit into a hard keep-or-drop.) No label,
trigger or target is read: only `data[t].images` (the paper's unlabeled test inputs). Given
`trigger` (the true one: the oracle ablation), the perturbed inputs are trigger(x) instead.

Where the authors' released code differs from the paper, the paper is followed:
- it trains ONE mask with both losses; here two masks, each with its own steps;
- its final mask is one random Concrete sample; here the deterministic expectation above;
- its inner λ gradient is taken at the λ before the previous update (stale) and λ's gradient
  from the mask step leaks into the next λ step; here each step's λ gradient is fresh and only
  the inner step moves λ;
- its λ is reset to 0.3 every iteration; here λ carries on, as AdaMerging's;
- its perturbation has no norm bound in practice and is clamped on normalized pixels; here
  ‖δ‖_∞ ≤ ε on [0, 1] pixels, and x + δ is clipped to [0, 1];
- its safe loss is the entropy of perturbed predictions; here the cross-entropy to the merged
  model's clean predictions, the paper's "predictions unchanged".
With `masks=()` nothing is masked and the result is AdaMerging's with `refit_steps` steps.
"""

import functools
from typing import Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from editing import settings
from editing import tree as tree_lib
from editing.errors import UserError
from editing.task_vector import TaskVector, check_compatible
from merging import adamerging
from merging import common

MASKS = ('shared', 'safe')
# λ's settings are AdaMerging's; its `steps` are the refit's here.
SETTINGS = dict(
    {k: s for k, s in adamerging.SETTINGS.items() if k != 'steps'},
    steps=settings.integer(100, '[1, inf)', 'iterations of mask learning'),
    refit_steps=settings.integer(100, '[0, inf)', 'AdaMerging steps of the final λ'),
    mask_learning_rate=settings.number(0.02, '[0, inf)', "Adam's learning rate for the mask "
                                       'logits (0: they stay at mask_init)'),
    mask_init=settings.number(0.0, '(-inf, inf)', "the mask logits' initial value"),
    temperature=settings.number(0.5, '(0, inf)', 'the Concrete temperature T'),
    bound=settings.number(0.2, '[0, inf)', 'ε of ‖δ‖_∞, on [0, 1] pixels'),
    perturbation_step=settings.number(0.02, '(0, 1]', 'each signed-gradient step on δ'),
    safety_weight=settings.number(1.0, '[0, inf)', "α, the safe loss's weight in the "
                                  "backdoor-detection mask's step"))


class Learned(NamedTuple):
  coefficients: common.PyTree  # λ after the refit, as adamerging.Learned's
  masks: dict[str, common.PyTree]  # name -> the final deterministic, rescaled mask
  perturbations: dict[str, jax.Array]  # task -> its synthesised trigger δ (if one was learned)
  objectives: list[dict[str, float]]  # per iteration, the losses before its updates


def concrete(logits: jax.Array, key: jax.Array, temperature: float) -> jax.Array:
  """A binary Concrete (relaxed Bernoulli) sample σ((ℓ + log u − log(1 − u)) / T)."""
  u = jax.random.uniform(key, logits.shape, minval=1e-6, maxval=1 - 1e-6)
  return jax.nn.sigmoid((logits + jnp.log(u) - jnp.log1p(-u)) / temperature)


def rescaled(mask: jax.Array) -> jax.Array:
  """m / mean(m), so a tensor keeps its expected sum; an all-zero mask stays zero."""
  mean = jnp.mean(mask)
  return jnp.where(mean > 0, mask / jnp.where(mean > 0, mean, 1.0), 0.0)


def sampled_mask(logits: common.PyTree, key: jax.Array, temperature: float) -> common.PyTree:
  """A rescaled Concrete sample of every leaf, each leaf's noise keyed by its path."""
  def sample(path, logit):
    return rescaled(concrete(logit, jax.random.fold_in(key, tree_lib.stable_hash(path)),
                             temperature))

  return tree_lib.map_with_path(sample, logits)


def final_mask(logits: common.PyTree) -> common.PyTree:
  """The deterministic mask: the expectation σ(ℓ), rescaled per tensor."""
  return jax.tree.map(lambda logit: rescaled(jax.nn.sigmoid(logit)), logits)


def masked(task_vectors: Sequence[TaskVector], mask: common.PyTree) -> list[TaskVector]:
  return [TaskVector(jax.tree.map(jnp.multiply, mask, v.delta), v.tasks, v.regime, v.base)
          for v in task_vectors]


@settings.declare(**SETTINGS)
def learn(task_vectors: Sequence[TaskVector], *, theta0: common.PyTree,
          data: Mapping[str, common.TaskData], key: jax.Array, masks: Sequence[str] = MASKS,
          trigger: Callable[[np.ndarray], np.ndarray] | None = None, granularity: str,
          steps: int, refit_steps: int, learning_rate: float, mask_learning_rate: float,
          mask_init: float, temperature: float, bound: float, perturbation_step: float,
          safety_weight: float, init: float, batch_size: int) -> Learned:
  """Learns the masks, then refits λ under them.

  Args:
    task_vectors: single-task vectors of one regime and base.
    theta0: the pretrained params.
    data: per task, its logits_fn and unlabeled images (labels, if any, are not read).
    key: every random draw (batches, Concrete noise) comes from it.
    masks: which of MASKS to learn; the others are all ones (the ablations).
    trigger: the true trigger, images -> images on [0, 1] floats (the oracle); None: the
      perturbation is synthesised.
    granularity, learning_rate, init, batch_size: λ's, as in AdaMerging.
    steps: iterations of mask learning; refit_steps: AdaMerging steps of the final λ.
    mask_learning_rate, mask_init, temperature: Adam's lr for the mask logits, their initial
      value, and the Concrete temperature T.
    bound, perturbation_step: ε of ‖δ‖_∞ and the size of each signed-gradient step on δ.
    safety_weight: α, the weight of the safe loss in the backdoor-detection mask's step.
  """
  check_compatible(task_vectors, 'dam')
  unknown = sorted(set(masks) - set(MASKS))
  if unknown:
    raise UserError(f'dam: unknown mask(s) {unknown}; known: {MASKS}')
  tasks = {t: common.task_of(v, data, 'dam') for v in task_vectors for t in v.tasks}
  learned_masks, perturbations, objectives = {}, {}, []
  if masks:
    learned_masks, perturbations, objectives = _learn_masks(
        task_vectors, theta0=theta0, tasks=tasks, key=key, masks=tuple(masks), trigger=trigger,
        granularity=granularity, steps=steps, learning_rate=learning_rate,
        mask_learning_rate=mask_learning_rate, mask_init=mask_init, temperature=temperature,
        bound=bound, perturbation_step=perturbation_step, safety_weight=safety_weight,
        init=init, batch_size=batch_size)
  vectors = task_vectors
  for mask in learned_masks.values():
    vectors = masked(vectors, mask)
  # No refit steps keep λ at its initial value (AdaMerging itself takes at least one step).
  coefficients = (adamerging.learn(vectors, theta0=theta0, data=data, key=key,
                                   granularity=granularity, steps=refit_steps,
                                   learning_rate=learning_rate, init=init,
                                   batch_size=batch_size).coefficients if refit_steps else
                  adamerging.initial_coefficients(len(vectors), theta0, granularity, init))
  if trigger is not None or 'safe' not in masks:
    perturbations = {}
  return Learned(coefficients, learned_masks, perturbations, objectives)


def _learn_masks(task_vectors, *, theta0, tasks, key, masks, trigger, granularity, steps,
                 learning_rate, mask_learning_rate, mask_init, temperature, bound,
                 perturbation_step, safety_weight, init, batch_size):
  """The alternating iterations; returns ({mask name: final mask}, perturbations, objectives)."""
  coefficients = adamerging.initial_coefficients(len(task_vectors), theta0, granularity, init)
  logits = {m: jax.tree.map(lambda d: jnp.full(d.shape, mask_init, jnp.float32),
                            task_vectors[0].delta) for m in masks}
  lambda_tx, mask_tx, step = _step(
      tuple((t, d.logits_fn) for t, d in tasks.items()), masks, learning_rate,
      mask_learning_rate, temperature, bound, perturbation_step, safety_weight)
  image_shape = next(iter(tasks.values())).images.shape[1:]
  perturbation = {t: jnp.zeros(image_shape, jnp.float32) for t in tasks}

  states = {'lambda': lambda_tx.init(coefficients), **{m: mask_tx.init(logits[m]) for m in masks}}
  objectives = []
  for i in range(steps):
    step_key = jax.random.fold_in(key, i)
    batches = adamerging.step_batches(tasks, batch_size, key, i)
    triggered = None
    if trigger is not None:
      triggered = {t: np.asarray(trigger(b), np.float32) for t, b in batches.items()}
    coefficients, logits, states, perturbation, objective = step(
        (theta0, list(task_vectors)), coefficients, logits, states, perturbation, batches,
        triggered, step_key)
    objectives.append({k: float(v) for k, v in objective.items()})
  return {m: final_mask(logits[m]) for m in masks}, perturbation, objectives


@functools.lru_cache(maxsize=16)
def _step(logits_fns, masks, learning_rate, mask_learning_rate, temperature, bound,
          perturbation_step, safety_weight):
  """(λ's optimizer, the masks' optimizer, the jitted iteration), built once per task set and
  settings so that repeated merges reuse one compiled program."""
  lambda_tx, mask_tx = optax.adam(learning_rate), optax.adam(mask_learning_rate)
  logits_fn = dict(logits_fns)

  def merged_params(fixed, coefficients, mask):
    theta0, task_vectors = fixed
    delta = adamerging.merged_delta(task_vectors, coefficients)
    return jax.tree.map(lambda t0, m, d: t0 + m * d, theta0, mask, delta)

  def mask_product(samples):
    return jax.tree.map(lambda *ms: functools.reduce(jnp.multiply, ms), *samples.values())

  def performance(params, batches):
    return sum(adamerging.entropy(logits_fn[t](params, batches[t])) for t in logits_fn)

  def safety(params, perturbed, predicted):
    return sum(optax.softmax_cross_entropy_with_integer_labels(
        logits_fn[t](params, perturbed[t]), predicted[t]).mean() for t in logits_fn)

  def perturbed_inputs(batches, perturbation, triggered):
    if triggered is not None:
      return triggered
    return {t: jnp.clip(batches[t] + perturbation[t], 0.0, 1.0) for t in logits_fn}

  # θ0 and the vectors (`fixed`) are arguments rather than closed-over constants, as in
  # adamerging.learn: faster to compile, and one program for every same-shaped merge.
  @jax.jit
  def step(fixed, coefficients, logits, states, perturbation, batches, triggered, key):
    states = dict(states)
    samples = {m: sampled_mask(logits[m], jax.random.fold_in(key, tree_lib.stable_hash(m)),
                               temperature) for m in masks}
    objective = {}
    # The inner step: AdaMerging's λ update under the sampled masks.
    fixed_masks = jax.lax.stop_gradient(mask_product(samples))
    value, grads = jax.value_and_grad(lambda c: performance(
        merged_params(fixed, c, fixed_masks), batches))(coefficients)
    objective['entropy'] = value
    updates, states['lambda'] = lambda_tx.update(grads, states['lambda'], coefficients)
    coefficients = optax.apply_updates(coefficients, updates)

    def with_mask(name, mask_logits):
      resampled = dict(samples, **{name: sampled_mask(
          mask_logits, jax.random.fold_in(key, tree_lib.stable_hash(name)), temperature)})
      return merged_params(fixed, coefficients, mask_product(resampled))

    if 'shared' in masks:
      grads = jax.grad(lambda shared: performance(with_mask('shared', shared), batches))(
          logits['shared'])
      updates, states['shared'] = mask_tx.update(grads, states['shared'], logits['shared'])
      logits = dict(logits, shared=optax.apply_updates(logits['shared'], updates))
    if 'safe' in masks:
      params = merged_params(fixed, coefficients, mask_product(samples))
      predicted = {t: jnp.argmax(logits_fn[t](params, batches[t]), -1) for t in logits_fn}
      if triggered is None:
        # The surrogate trigger: one signed ascent step on the merged model's loss, projected.
        ascent = jax.grad(lambda p: safety(params, perturbed_inputs(batches, p, None),
                                           predicted))(perturbation)
        perturbation = {t: jnp.clip(perturbation[t] + perturbation_step * jnp.sign(ascent[t]),
                                    -bound, bound) for t in logits_fn}
      perturbed = perturbed_inputs(batches, perturbation, triggered)

      def safe_objective(mask_logits):
        params = with_mask('safe', mask_logits)
        safe = safety(params, perturbed, predicted)
        return performance(params, batches) + safety_weight * safe, safe

      (_, safe), grads = jax.value_and_grad(safe_objective, has_aux=True)(logits['safe'])
      objective['safety'] = safe
      updates, states['safe'] = mask_tx.update(grads, states['safe'], logits['safe'])
      logits = dict(logits, safe=optax.apply_updates(logits['safe'], updates))
    return coefficients, logits, states, perturbation, objective

  return lambda_tx, mask_tx, step


@settings.declare(**SETTINGS)
def merge(task_vectors: Sequence[TaskVector], *, theta0: common.PyTree,
          data: Mapping[str, common.TaskData], key: jax.Array,
          **learned_with) -> TaskVector:
  """Σ_k λ_k (M_s ⊙ M_b ⊙ τ_k) with the learned masks and refitted coefficients;
  `learned_with` are `learn`'s masks, trigger and settings."""
  learned = learn(task_vectors, theta0=theta0, data=data, key=key, **learned_with)
  vectors = list(task_vectors)
  for mask in learned.masks.values():
    vectors = masked(vectors, mask)
  return common.merged(task_vectors, adamerging.merged_delta(vectors, learned.coefficients))
