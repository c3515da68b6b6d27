"""The one training loop: pretraining and every fine-tuning regime go through `train`.

What varies between jobs comes in as data: a loss function over the full params tree, which
leaves are trainable, and an optimizer built from the config. The loop owns what must be right
once: a jitted step with explicit shardings and donated state, stateless batch order (a pure
function of the step), orbax checkpoints of params, optimizer state, step and RNG so that a run
killed anywhere and restarted finishes with bit-identical params, SIGTERM handling, a non-finite
loss check, progress on the console, and metrics as JSONL and TensorBoard events.
"""

import contextlib
import json
import os
import signal
from concurrent import futures
import threading
import time
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from editing import atomic
from editing import checkpoint
from editing import distributed
from editing import sharding as sharding_lib
from editing import tree as tree_lib
from editing.data.suite import Dataset, batch_indices
from editing.errors import UserError

PyTree = Any
# loss_fn(params, consts, images, labels, rng) -> (scalar loss, dict of scalar metrics)
LossFn = Callable[[PyTree, PyTree, jax.Array, jax.Array, jax.Array], tuple[jax.Array, dict]]


class Preempted(Exception):
  """Raised after a SIGTERM once the state is checkpointed; rerun the same command to resume."""


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: dict[str, jax.Array]  # trainable leaves only, keyed by path
  opt_state: optax.OptState
  rng: jax.Array


def optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformationExtraArgs:
  """AdamW on a linear-warmup cosine schedule after global-norm clipping, then `mask_updates`."""
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(learning_rate(config), weight_decay=config.weight_decay),
      mask_updates())


def mask_updates() -> optax.GradientTransformationExtraArgs:
  """u ← m ⊙ u for the leaves given elementwise masks in the `update_mask` argument.

  Placed last, it zeroes both the Adam step and AdamW's decoupled weight decay outside the
  mask, while the clip and Adam's moments before it still see the unmasked gradients: the
  sparse optimizer of TaLoS (Iurada et al., ICLR 2025). `update_mask` is {path: bool array}
  over some of the (flat, path-keyed) updates; leaves it does not name pass unchanged.
  """

  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None, *, update_mask=None, **extra_args):
    del params, extra_args
    if update_mask:
      updates = {path: u * update_mask[path].astype(u.dtype) if path in update_mask else u
                 for path, u in updates.items()}
    return updates, state

  return optax.GradientTransformationExtraArgs(init, update)


def learning_rate(config: ml_collections.ConfigDict) -> optax.Schedule:
  warmup = min(config.warmup_steps, config.steps - 1)
  return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup,
                                            max(config.steps, warmup + 1))


class _Preemption:
  """Whether to checkpoint and stop: a SIGTERM (a preemption notice) to any process, answered
  alike on every process.

  The save is collective, so the processes must agree on the step. With one process a SIGTERM
  handler notes the notice, and a notice is never dropped: one that comes after the last
  step's check (while that step's losses are read or its state saved) still stops the run,
  once that state is saved (`noticed`). With several, JAX's preemption sync manager, started
  with `jax.distributed` (its own SIGTERM handler, left in place), passes one process's notice
  to all and picks a step every process can still reach (orbax's `reached_preemption`, as in
  MaxText); it must be asked at every step. It is off if `jax_enable_preemption_service` is,
  and then a SIGTERM ends the process unsaved.
  """

  def __init__(self, mngr):
    self._mngr = mngr
    self._alone = jax.process_count() == 1
    self._raised = False
    self._reached = False
    self._previous = None

  def __enter__(self):
    if self._alone and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self._raised = True

  def reached(self, step: int) -> bool:
    """Whether to save `step` and stop; call it once per step, on every process."""
    self._reached = self._raised if self._alone else self._mngr.reached_preemption(step)
    return self._reached

  @property
  def noticed(self) -> bool:
    """Whether to stop once the loop is over and its last state saved: a notice came at any
    time so far (one process), or the processes reached the step they agreed on."""
    return self._raised if self._alone else self._reached

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


class _MetricWriter:
  """One JSON line and one TensorBoard scalar per metric; drops lines past a resumed step."""

  def __init__(self, workdir: str, resumed_step: int):
    self._primary = distributed.is_primary()
    self._path = os.path.join(workdir, 'metrics.jsonl')
    if os.path.exists(self._path):
      with open(self._path) as f:
        kept = [line for line in f if _logged_step(line) <= resumed_step]
      atomic.write_bytes(self._path, ''.join(kept).encode())
    if not self._primary:
      return
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'), purge_step=resumed_step + 1)
    self._file = open(self._path, 'a')

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self._primary:
      return
    self._file.write(json.dumps({'step': step, **metrics}) + '\n')
    self._file.flush()
    for name, value in metrics.items():
      self._tb.add_scalar(name, value, step)

  def close(self) -> None:
    if not self._primary:
      return
    self._file.close()
    self._tb.close()


class StepInputs(NamedTuple):
  """What every step reads and never changes."""

  frozen: dict[str, jax.Array]  # the leaves that do not train, keyed by path
  update_mask: dict[str, jax.Array]  # elementwise masks of sparsely trained leaves, by path
  consts: PyTree  # what the loss reads besides the params (θ0, a frozen head)


class Prepared(NamedTuple):
  """Everything a loop needs: the initial state, the jitted step and its constant inputs."""

  state: TrainState
  inputs: StepInputs
  step: Callable  # step(state, inputs, images, labels) -> (state, metrics)
  batch_sharding: jax.sharding.NamedSharding


def prepare(config: ml_collections.ConfigDict, *, loss_fn: LossFn, params: PyTree,
            trainable: dict[str, bool], consts: PyTree, mesh: jax.sharding.Mesh,
            sharding_rules=sharding_lib.REPLICATED_RULES,
            update_mask: dict[str, Any] | None = None) -> Prepared:
  """Places params on the mesh, splits trainable from frozen leaves and jits the step.

  The step differentiates only the trainable leaves, so frozen ones cost no backward pass and
  hold no optimizer state; the state is donated, and every input and output has an explicit
  sharding (params and constants by `sharding_rules`, batches over data × fsdp, metrics
  replicated).
  `update_mask` ({path: bool array}) restricts the updates of the leaves it names to their
  True entries; a leaf whose mask is all False is frozen outright.
  """
  sharding_lib.check_batch_size(mesh, config.batch_size)
  flat = tree_lib.flatten(params)
  if trainable.keys() != flat.keys():
    raise ValueError(f'trainable marks {sorted(trainable.keys() ^ flat.keys())[:3]}..., which '
                     'are not exactly the params leaves')
  update_mask = _checked_mask(update_mask or {}, flat)
  trainable = {p: t and (p not in update_mask or bool(update_mask[p].any()))
               for p, t in trainable.items()}
  if not any(trainable.values()):
    raise UserError('no parameter is trainable')
  flat_shardings = tree_lib.flatten(
      sharding_lib.param_shardings(mesh, params, sharding_rules))
  trained = {p: v for p, v in flat.items() if trainable[p]}
  frozen = {p: v for p, v in flat.items() if not trainable[p]}
  trained = jax.device_put(trained, {p: flat_shardings[p] for p in trained})
  frozen = jax.device_put(frozen, {p: flat_shardings[p] for p in frozen})
  update_mask = jax.device_put({p: m for p, m in update_mask.items() if trainable[p]},
                               {p: flat_shardings[p] for p in update_mask if trainable[p]})
  # Constants are placed by the same rules: θ0 (read by the linearized model and the frozen
  # head's loss) splits as the params do, leaves no rule names (a head) are replicated.
  inputs = StepInputs(frozen, update_mask, jax.device_put(
      consts, sharding_lib.param_shardings(mesh, consts, sharding_rules)))

  tx = optimizer(config)
  schedule = learning_rate(config)
  init = jax.jit(lambda p: TrainState(jnp.zeros((), jnp.int32), p, tx.init(p),
                                      jax.random.PRNGKey(config.seed)))
  state = init(trained)
  state_shardings = jax.tree.map(lambda x: x.sharding, state)

  microbatches = config.get('accumulation', 1)
  if config.batch_size % microbatches:
    raise UserError(f'batch_size={config.batch_size} does not split into {microbatches} equal '
                    'microbatches (accumulation)')

  def step_fn(state, inputs, images, labels):
    rng, step_rng = jax.random.split(state.rng)

    def loss_and_grads(images, labels):
      def loss_of_trained(trained):
        return loss_fn(tree_lib.unflatten({**trained, **inputs.frozen}), inputs.consts, images,
                       labels, step_rng)
      return jax.value_and_grad(loss_of_trained, has_aux=True)(state.params)

    if microbatches == 1:
      (loss, metrics), grads = loss_and_grads(images, labels)
    else:
      # Equal microbatches of a mean loss: the mean of their losses and gradients is the
      # whole batch's, at a microbatch's activation memory.
      split = lambda x: x.reshape((microbatches, -1) + x.shape[1:])

      def accumulate(total, batch):
        return jax.tree.map(jnp.add, total, loss_and_grads(*batch)), None

      zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                          jax.eval_shape(loss_and_grads, split(images)[0], split(labels)[0]))
      total, _ = jax.lax.scan(accumulate, zero, (split(images), split(labels)))
      (loss, metrics), grads = jax.tree.map(lambda x: x / microbatches, total)
    updates, opt_state = tx.update(grads, state.opt_state, state.params,
                                   update_mask=inputs.update_mask)
    new_state = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state,
                           rng)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                   learning_rate=schedule(state.step))
    return new_state, metrics

  batch = sharding_lib.batch_sharding(mesh)
  step_jit = jax.jit(
      step_fn, donate_argnums=(0,),
      in_shardings=(state_shardings, jax.tree.map(lambda x: x.sharding, inputs), batch, batch),
      out_shardings=(state_shardings, sharding_lib.replicated(mesh)))
  return Prepared(state, inputs, step_jit, batch)


def _checked_mask(update_mask: dict[str, Any], flat: dict[str, Any]) -> dict[str, np.ndarray]:
  for path, mask in update_mask.items():
    if path not in flat:
      raise ValueError(f'update_mask names {path!r}, which is not a params leaf')
    if np.shape(mask) != np.shape(flat[path]):
      raise ValueError(f'update_mask[{path!r}] has shape {np.shape(mask)}, the leaf '
                       f'{np.shape(flat[path])}')
  return {path: np.asarray(mask, bool) for path, mask in update_mask.items()}


def train(config: ml_collections.ConfigDict, *, loss_fn: LossFn, params: PyTree,
          trainable: dict[str, bool], consts: PyTree, data: Dataset, workdir: str,
          mesh: jax.sharding.Mesh, sharding_rules=sharding_lib.REPLICATED_RULES,
          update_mask: dict[str, Any] | None = None) -> PyTree:
  """Trains the `trainable` leaves of `params` on `data`, resuming from `workdir` if possible.

  Args:
    config: steps, batch_size, learning_rate, weight_decay, warmup_steps, grad_clip, seed,
      checkpoint_every, log_every; accumulation (default 1) splits each batch into that many
      microbatches whose gradients are averaged before the update.
    loss_fn: loss_fn(params, consts, images, labels, rng) -> (loss, metrics).
    params: the full initial params tree.
    trainable: {path: bool}; frozen leaves are never differentiated and get no optimizer state.
    consts: arrays the loss reads but never trains (e.g. θ0, a frozen head), as jit arguments.
    data: the training set: the suite's `Dataset`, or any object with `len` and
      batch(indices) -> (images, labels) (e.g. `editing.data.images.ImageDataset`).
    workdir: where checkpoints, metrics.jsonl and TensorBoard events go.
    mesh: the device mesh; batches are split over its 'data' axis.
    sharding_rules: (regex, partition spec) pairs placing the params; first match wins.
    update_mask: {path: bool array}; those leaves change only where True (see `prepare`).

  Returns:
    The full params tree after `config.steps` steps (frozen leaves are the inputs, untouched).

  Raises:
    Preempted: a SIGTERM reached any process while it trained; every process saved the same
      step first. A notice after the last step's check stops the run too, once the last
      step is saved: no notice is dropped.
    FloatingPointError: a step's loss was not finite; the message names the first such step.
      Losses are read from the device only at the steps that log (every `log_every`) or save
      (a checkpoint, the last step), so that the steps between are dispatched without
      waiting for the last; the error comes at the first of those after the step, before
      anything is saved there.
  """
  state, inputs, step_jit, batch = prepare(
      config, loss_fn=loss_fn, params=params, trainable=trainable, consts=consts, mesh=mesh,
      sharding_rules=sharding_rules, update_mask=update_mask)
  os.makedirs(workdir, exist_ok=True)
  # Left in reverse order, each exit run even if one before fails: the reader stops, the
  # last save finishes under the SIGTERM handler (a notice at any moment stops the run with
  # a saved state), the files close, and a full disk met anywhere is one line.
  with contextlib.ExitStack() as stack:
    stack.enter_context(checkpoint.disk_full_named(workdir))
    mngr = checkpoint.manager(os.path.join(workdir, 'checkpoints'),
                              save_every=config.checkpoint_every)
    stack.callback(mngr.close)
    restored = checkpoint.restore_latest(mngr, state)
    if restored is not None:
      state = restored
      logging.info('resumed from step %d in %s', int(state.step), workdir)
    start = done = int(state.step)
    writer = _MetricWriter(workdir, start)
    stack.callback(writer.close)
    preemption = stack.enter_context(_Preemption(mngr))
    stack.callback(mngr.wait_until_finished)
    reader = stack.enter_context(futures.ThreadPoolExecutor(1))
    timer = (time.time(), start)
    # The next batch is read (and, for real images, decoded) in a thread while the device
    # runs the current step; its indices are a pure function of the step, so the order is
    # unchanged. Each process reads only the rows its devices hold (all on a single host).
    read = lambda step: distributed.global_batch(
        data.batch, batch_indices(len(data), config.batch_size, step, config.seed), batch)
    upcoming = reader.submit(read, start) if start < config.steps else None
    unchecked = []  # the losses of the steps since the last check, on the device
    for step in range(start, config.steps):
      images, labels = upcoming.result()
      if step + 1 < config.steps:
        upcoming = reader.submit(read, step + 1)
      state, metrics = step_jit(state, inputs, images, labels)
      done = step + 1
      unchecked.append(metrics['loss'])
      preempted = preemption.reached(done)
      save = done == config.steps or preempted or mngr.should_save(done)
      log = done % config.log_every == 0 or done == config.steps
      # Losses are read from the device only where the loop waits for it anyway (a save, a
      # log line), so the steps between are dispatched without waiting; before any save, so
      # that no checkpoint ever holds a diverged state.
      if save or log:
        _check_finite(jax.device_get(unchecked), done, workdir)
        unchecked = []
      if save:
        mngr.save(done, args=checkpoint.ocp.args.StandardSave(state), force=True)
      if log:
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        timer = _log_progress(done, config.steps, config.batch_size, metrics, timer)
        writer.write(done, metrics)
      if preempted:
        break
    mngr.wait_until_finished()
    if preemption.noticed:
      raise Preempted(f'SIGTERM: saved step {done} in {workdir}; rerun to resume')
  return tree_lib.unflatten(distributed.to_host({**state.params, **inputs.frozen}))


def _check_finite(losses: list[np.ndarray], done: int, workdir: str) -> None:
  """A FloatingPointError naming the first non-finite of the losses of the steps up to `done`."""
  for step, loss in enumerate(losses, start=done - len(losses) + 1):
    if not np.isfinite(loss):
      raise FloatingPointError(f'non-finite loss {loss} at step {step} in {workdir}; '
                               'lower the learning rate or check the data')


def _logged_step(line: str) -> float:
  """The step of a metrics line; a line cut short by a kill counts as past any step."""
  try:
    return json.loads(line)['step']
  except (json.JSONDecodeError, KeyError):
    return float('inf')


def _log_progress(step, total, batch_size, metrics, timer):
  then, then_step = timer
  now = time.time()
  rate = (step - then_step) / max(now - then, 1e-9)
  eta = (total - step) / max(rate, 1e-9)
  logging.info('step %d/%d  loss %.4f  %.0f examples/s  eta %dm%02ds', step, total,
               metrics['loss'], rate * batch_size, eta // 60, eta % 60)
  return now, step
