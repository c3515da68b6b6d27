"""The one training loop: bit-identical resume after a kill, data parallelism, frozen leaves,
the non-finite loss stop."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import quickstart
from editing import sharding
from editing import train
from editing import tree as tree_lib
from editing.data import suite
from tests.conftest import REPO, xla_flags

DRIVER = os.path.join('tests', 'train_driver.py')


def load(path):
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def assert_bitwise_equal(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)


def latest_checkpoint(workdir):
  directory = os.path.join(workdir, 'checkpoints')
  steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(directory) else []
  return max(steps, default=0)


# Resuming is the loop's, whatever the regime; talos adds the one extra step input (its update
# mask), and the other regimes only change which leaves train or the encoder: talos stands for
# all of them.
def test_killed_run_resumes_to_bit_identical_params(tmp_path, run_python):
  regime, steps = 'talos', 24
  # The reference run saves only at the end: checkpoints never change the params.
  run_python([DRIVER, f'--workdir={tmp_path / "straight"}', f'--out={tmp_path / "a.npz"}',
              f'--steps={steps}', f'--regime={regime}', f'--checkpoint_every={steps}'])

  killed = tmp_path / 'killed'
  env = dict(os.environ, PYTHONPATH=REPO)
  proc = subprocess.Popen([sys.executable, DRIVER, f'--workdir={killed}',
                           f'--out={tmp_path / "unused.npz"}', f'--steps={steps}',
                           f'--regime={regime}'], cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while latest_checkpoint(killed) < 6 and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  interrupted_at = latest_checkpoint(killed)
  assert 0 < interrupted_at < steps, f'the run was not killed mid-way ({interrupted_at})'

  run_python([DRIVER, f'--workdir={killed}', f'--out={tmp_path / "b.npz"}', f'--steps={steps}',
              f'--regime={regime}'])
  assert_bitwise_equal(load(tmp_path / 'a.npz'), load(tmp_path / 'b.npz'))
  logged = [int(line.split('"step": ')[1].split(',')[0])
            for line in open(killed / 'metrics.jsonl')]
  assert logged == list(range(1, steps + 1)), 'resumed metrics repeat or skip steps'


def started(workdir) -> bool:
  """Whether the run in `workdir` has logged a step: its SIGTERM handling is in place then
  (the metrics file itself is opened before)."""
  metrics = workdir / 'metrics.jsonl'
  return metrics.exists() and metrics.stat().st_size > 0


def wait_until_started(workdir, processes):
  deadline = time.time() + 300
  while not started(workdir):
    assert all(p.poll() is None for p in processes), 'a run ended before its first step'
    assert time.time() < deadline, 'no step was logged in 300 s'
    time.sleep(0.05)


def test_sigterm_checkpoints_then_stops(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO)
  workdir = tmp_path / 'run'
  proc = subprocess.Popen([sys.executable, DRIVER, f'--workdir={workdir}',
                           f'--out={tmp_path / "x.npz"}', '--steps=400', '--checkpoint_every=1000'],
                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
  wait_until_started(workdir, [proc])
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode != 0 and 'Preempted' in stderr
  saved = latest_checkpoint(workdir)
  assert 0 < saved < 400, 'no checkpoint was written on SIGTERM'
  assert not (tmp_path / 'x.npz').exists()


def test_sigterm_to_one_of_two_processes_checkpoints_one_step_on_both_then_stops(tmp_path):
  """The save is collective: the process that got no SIGTERM must save the same step and
  stop too, rather than leave the other waiting in the save (and itself in the next step)."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices=1),
             PYTHONPATH=REPO)
  workdir = tmp_path / 'run'
  processes = [subprocess.Popen(
      [sys.executable, DRIVER, '--steps=400', '--devices=2', '--checkpoint_every=1000',
       f'--workdir={workdir}', f'--out={tmp_path / "x.npz"}',
       f'--coordinator_address=localhost:{port}', '--num_processes=2', f'--process_id={i}'],
      cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  try:
    wait_until_started(workdir, processes)
    processes[1].send_signal(signal.SIGTERM)
    stderrs = [p.communicate(timeout=120)[1] for p in processes]
  except subprocess.TimeoutExpired:
    pytest.fail('the processes hung after a SIGTERM to one of them')
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
        p.wait()
  saved = []
  for i, (p, stderr) in enumerate(zip(processes, stderrs)):
    found = re.search(r'Preempted: SIGTERM: saved step (\d+)', stderr)
    assert p.returncode != 0 and found, f'process {i}:\n{stderr[-3000:]}'
    saved.append(int(found.group(1)))
  assert saved[0] == saved[1] == latest_checkpoint(workdir), saved
  assert 0 < saved[0] < 400
  assert not (tmp_path / 'x.npz').exists()


def tiny_problem():
  params = {'w': jnp.ones((3, 2)), 'b': jnp.zeros((2,)), 'frozen': {'v': jnp.full((2,), 5.0)}}
  images = np.random.default_rng(0).uniform(size=(64, 32, 32, 3)).astype(np.float32)
  labels = (images[:, 0, 0, 0] > 0.5).astype(np.int32)
  data = suite.Dataset((images * 255).astype(np.uint8), labels)

  def loss_fn(params, consts, images, labels, rng):
    del consts, rng
    x = images[:, 0, 0, :]
    logits = x @ params['w'] + params['b'] + params['frozen']['v']
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), {}

  return params, data, loss_fn


def train_tiny_problem(workdir, steps=6):
  """The params of a run of `tiny_problem` in `workdir` (resumed if it holds one), saved
  every 2 steps."""
  params, data, loss_fn = tiny_problem()
  config = quickstart.training(steps=steps, batch_size=16, checkpoint_every=2, log_every=2)
  return train.train(config, loss_fn=loss_fn, params=params,
                     trainable={'w': True, 'b': True, 'frozen/v': False}, consts={}, data=data,
                     workdir=str(workdir), mesh=sharding.make_mesh(1))


def test_frozen_leaves_stay_bit_identical_and_get_no_optimizer_state(tmp_path, monkeypatch):
  params, data, loss_fn = tiny_problem()
  seen_state = []
  original_init = train.TrainState.__init__

  def spy(self, step, params, opt_state, rng):
    seen_state.append(opt_state)
    original_init(self, step, params, opt_state, rng)

  monkeypatch.setattr(train.TrainState, '__init__', spy)
  trainable = {'w': True, 'b': True, 'frozen/v': False}
  config = quickstart.training(steps=5, batch_size=16, checkpoint_every=5, log_every=5)
  out = train.train(config, loss_fn=loss_fn, params=params, trainable=trainable, consts={},
                    data=data, workdir=str(tmp_path), mesh=sharding.make_mesh(1))
  np.testing.assert_array_equal(out['frozen']['v'], params['frozen']['v'])
  assert not np.array_equal(out['w'], params['w'])
  state_paths = {p for s in seen_state for p in tree_lib.flatten(s)}
  assert state_paths and not any('frozen' in p for p in state_paths)


def test_non_finite_loss_stops_the_run_with_the_step(tmp_path):
  params, data, _ = tiny_problem()

  def exploding(params, consts, images, labels, rng):
    del consts, images, labels, rng
    return jnp.log(params['b'][0] - params['b'][0]), {}

  config = quickstart.training(steps=5, batch_size=16, checkpoint_every=1, log_every=5)
  with pytest.raises(FloatingPointError, match='non-finite loss .* at step 1'):
    train.train(config, loss_fn=exploding, params=params,
                trainable={p: True for p in tree_lib.flatten(params)}, consts={}, data=data,
                workdir=str(tmp_path), mesh=sharding.make_mesh(1))
  assert latest_checkpoint(str(tmp_path)) == 0, 'a diverged state was checkpointed'


def test_a_non_finite_loss_between_checks_stops_the_run_with_its_step(tmp_path):
  params, data, loss_fn = tiny_problem()

  def diverging(params, consts, images, labels, rng):
    # Finite at the first step (b = 0), NaN once the first update has moved b.
    loss, metrics = loss_fn(params, consts, images, labels, rng)
    return loss + jnp.where(params['b'][0] == 0, 0.0, jnp.nan), metrics

  # Steps 2 and 3 are neither logged nor saved: their losses are read at step 4.
  config = quickstart.training(steps=6, batch_size=16, warmup_steps=0, checkpoint_every=4,
                               log_every=4)
  with pytest.raises(FloatingPointError, match='non-finite loss nan at step 2 '):
    train.train(config, loss_fn=diverging, params=params,
                trainable={p: True for p in tree_lib.flatten(params)}, consts={}, data=data,
                workdir=str(tmp_path), mesh=sharding.make_mesh(1))
  assert latest_checkpoint(str(tmp_path)) == 1, 'a diverged state was checkpointed'


def test_steps_between_logs_and_saves_are_dispatched_before_the_last_one_finished(
    tmp_path, monkeypatch):
  params, data, loss_fn = tiny_problem()

  def slow_loss(params, consts, images, labels, rng):
    # Tens of milliseconds of device work a step, far longer than the loop's own.
    busy = jax.lax.fori_loop(0, 40, lambda i, b: jnp.tanh(b @ b), jnp.full((256, 256), 0.01))
    loss, metrics = loss_fn(params, consts, images, labels, rng)
    return loss + 1e-9 * busy.mean(), metrics

  ready = []  # at each step's dispatch, whether the previous step had finished

  def prepare(*args, **kwargs):
    prepared = original(*args, **kwargs)
    losses = []

    def step(*step_args):
      if losses:
        ready.append(losses[-1].is_ready())
      state, metrics = prepared.step(*step_args)
      losses.append(metrics['loss'])
      return state, metrics

    return prepared._replace(step=step)

  original = train.prepare
  monkeypatch.setattr(train, 'prepare', prepare)
  # Orbax saves the first step of a fresh run, then nothing is read until step 8.
  config = quickstart.training(steps=8, batch_size=16, checkpoint_every=8, log_every=8)
  train.train(config, loss_fn=slow_loss, params=params,
              trainable={'w': True, 'b': True, 'frozen/v': False}, consts={}, data=data,
              workdir=str(tmp_path), mesh=sharding.make_mesh(1))
  assert len(ready) == 7 and not all(ready), ready


def test_nothing_trainable_is_an_error(tmp_path):
  params, data, loss_fn = tiny_problem()
  config = quickstart.training(steps=1, batch_size=16)
  with pytest.raises(ValueError, match='no parameter is trainable'):
    train.train(config, loss_fn=loss_fn, params=params,
                trainable={p: False for p in tree_lib.flatten(params)}, consts={}, data=data,
                workdir=str(tmp_path), mesh=sharding.make_mesh(1))


def test_batch_size_must_split_over_the_data_axis():
  eight_devices = types.SimpleNamespace(shape={sharding.DATA_AXIS: 8})
  sharding.check_batch_size(eight_devices, 64)
  with pytest.raises(ValueError, match='batch_size=12 is not divisible by the 8 devices'):
    sharding.check_batch_size(eight_devices, 12)


def test_update_mask_moves_only_its_entries_while_adam_sees_every_gradient():
  params, data, loss_fn = tiny_problem()
  mask = np.array([[True, False], [False, False], [True, True]])
  config = quickstart.training(steps=4, batch_size=16, weight_decay=0.5)
  trainable = {'w': True, 'b': True, 'frozen/v': False}
  prepared = train.prepare(config, loss_fn=loss_fn, params=params, trainable=trainable,
                           consts={}, mesh=sharding.make_mesh(1),
                           update_mask={'w': mask, 'b': np.zeros(2, bool)})
  assert set(prepared.state.params) == {'w'}, 'an all-False mask must freeze its leaf'
  state = prepared.state
  for step in range(config.steps):
    images, labels = data.batch(suite.batch_indices(len(data), 16, step, 0))
    state, _ = prepared.step(state, prepared.inputs, images, labels)
  w0, w = np.asarray(params['w']), np.asarray(state.params['w'])
  np.testing.assert_array_equal(w[~mask].view(np.uint32), w0[~mask].view(np.uint32))
  assert (w[mask] != w0[mask]).all()
  first_moment = next(s for s in jax.tree.leaves(
      state.opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
                      if isinstance(s, optax.ScaleByAdamState)).mu['w']
  assert (np.asarray(first_moment)[~mask] != 0).all(), 'moments must see unmasked gradients'


def test_update_mask_errors_name_the_leaf():
  params, _, loss_fn = tiny_problem()
  kwargs = dict(loss_fn=loss_fn, params=params, trainable={'w': True, 'b': True,
                                                           'frozen/v': False},
                consts={}, mesh=sharding.make_mesh(1))
  config = quickstart.training(batch_size=16)
  with pytest.raises(ValueError, match="update_mask names 'w2'"):
    train.prepare(config, update_mask={'w2': np.ones((3, 2), bool)}, **kwargs)
  with pytest.raises(ValueError, match=r"update_mask\['b'\] has shape \(3,\)"):
    train.prepare(config, update_mask={'b': np.ones(3, bool)}, **kwargs)


def test_bfloat16_compute_keeps_float32_params_optimizer_state_and_task_vectors():
  from editing import regimes  # pylint: disable=g-import-not-at-top
  from editing.models import head as head_lib  # pylint: disable=g-import-not-at-top
  from editing.models import vit  # pylint: disable=g-import-not-at-top
  from editing.task_vector import TaskVector  # pylint: disable=g-import-not-at-top
  task = suite.load_task('colour', seed=0, train_size=64, test_size=8)
  images, labels = task.train.batch(np.arange(32))
  losses, dtypes = {}, {}
  for dtype in ('float32', 'bfloat16'):
    model = quickstart.get_config('tiny').model
    model.dtype = dtype
    module = vit.build(model)
    apply_fn = lambda p, x, module=module: module.apply({'params': p}, x)
    theta0 = module.init(jax.random.PRNGKey(0), images[:1])['params']
    head = jax.random.normal(jax.random.PRNGKey(1), (task.num_classes, model.embed_dim))
    encoder = regimes.get('full').encoder(apply_fn)
    prepared = train.prepare(quickstart.training(steps=3, batch_size=32, warmup_steps=1),
                             loss_fn=head_lib.frozen_head_loss(encoder, 10.0), params=theta0,
                             trainable={p: True for p in tree_lib.flatten(theta0)},
                             consts={'theta0': theta0, 'head': head}, mesh=sharding.make_mesh(1))
    state, run = prepared.state, []
    for _ in range(3):
      state, metrics = prepared.step(state, prepared.inputs, images, labels)
      run.append(float(metrics['loss']))
    losses[dtype] = run
    vector = TaskVector.from_params(theta0, tree_lib.unflatten(dict(state.params)),
                                    task='colour', regime='full')
    dtypes[dtype] = ({x.dtype for x in jax.tree.leaves((state.params, state.opt_state))
                      if jnp.issubdtype(x.dtype, jnp.floating)},
                     {x.dtype for x in jax.tree.leaves(vector.delta)},
                     apply_fn(theta0, images[:2]).dtype)
  # The master params, Adam's moments and τ stay float32; the forward pass computes in bf16.
  f32 = np.dtype(np.float32)
  assert dtypes['bfloat16'][:2] == dtypes['float32'][:2] == ({f32}, {f32})
  assert dtypes['bfloat16'][2] == jnp.bfloat16 and dtypes['float32'][2] == f32
  np.testing.assert_allclose(losses['bfloat16'], losses['float32'], rtol=0.05)
  assert losses['bfloat16'][-1] < losses['bfloat16'][0]


def test_accumulated_microbatches_take_the_whole_batchs_step():
  params, data, loss_fn = tiny_problem()
  images, labels = data.batch(np.arange(32))
  results = {}
  for accumulation in (1, 4):
    config = quickstart.training(steps=3, batch_size=32, accumulation=accumulation)
    prepared = train.prepare(config, loss_fn=loss_fn, params=params,
                             trainable={'w': True, 'b': True, 'frozen/v': False}, consts={},
                             mesh=sharding.make_mesh(1))
    state, seen = prepared.state, []
    for _ in range(3):
      state, metrics = prepared.step(state, prepared.inputs, images, labels)
      seen.append((float(metrics['loss']), float(metrics['grad_norm'])))
    results[accumulation] = (seen, jax.device_get(state.params))
  # The loss and the gradient itself (its norm: Adam alone would hide a scaled gradient).
  np.testing.assert_allclose(results[4][0], results[1][0], rtol=1e-6)
  for k in ('w', 'b'):
    np.testing.assert_allclose(results[4][1][k], results[1][1][k], rtol=0, atol=1e-6)
  assert not np.allclose(results[1][1]['w'], params['w'])
  with pytest.raises(ValueError, match='does not split into 3 equal microbatches'):
    train.prepare(quickstart.training(batch_size=32, accumulation=3), loss_fn=loss_fn,
                  params=params, trainable={'w': True, 'b': True, 'frozen/v': False},
                  consts={}, mesh=sharding.make_mesh(1))
