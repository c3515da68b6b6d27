"""A job ends the way its user can act on: a SIGTERM at any moment saves and stops it, a full
disk is one line naming the workdir and the rerun resumes, and an adapter PEFT would refuse
is refused by name."""

import errno
import os
import re
import shutil
import signal

import numpy as np
import pytest

from editing import checkpoint
from editing import train
from editing import tree as tree_lib
from editing.errors import UserError
from editing.jobs import cli
from editing.jobs import evaluate
from editing.jobs import experiment
from editing.jobs import finetune
from editing.jobs import quickstart
from editing.jobs import workdir as workdir_lib
from editing.models import hf
from editing.models import peft_adapter
from merging.checkpoints import job as checkpoint_job
from merging.checkpoints import plan as plan_lib
from tests import test_hf
from tests import test_train
from tests.test_peft_adapter import clip_setup, edit_config, peft
from tests.test_train import assert_bitwise_equal, latest_checkpoint

STEPS = 6


def train_tiny(workdir):
  """The flat params of a 6-step run of the tiny problem in `workdir`."""
  return {k: np.asarray(v)
          for k, v in tree_lib.flatten(test_train.train_tiny_problem(workdir, STEPS)).items()}


@pytest.fixture(scope='module', name='straight')
def straight_fixture(tmp_path_factory):
  """The params of an uninterrupted run, for resumed runs to equal bit for bit."""
  return train_tiny(tmp_path_factory.mktemp('straight'))


class Notices:
  """A SIGTERM handler that keeps the notices it gets."""

  def __init__(self):
    self.got = []

  def __call__(self, signum, frame):
    del frame
    self.got.append(signum)


@pytest.fixture(name='outer_sigterm')
def outer_sigterm_fixture():
  """A SIGTERM handler around the test, as a job's is around its training (and so that a
  notice training drops cannot kill the test run)."""
  notices = Notices()
  previous = signal.signal(signal.SIGTERM, notices)
  yield notices
  signal.signal(signal.SIGTERM, previous)


def sigterm_at_last_check(monkeypatch, steps):
  """A SIGTERM to this process once the last step's notice check has passed: while the losses
  up to that step are read from the device."""
  check = train._check_finite  # pylint: disable=protected-access

  def check_then_sigterm(losses, done, workdir):
    check(losses, done, workdir)
    if done == steps:
      os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(train, '_check_finite', check_then_sigterm)


def sigterm_in_last_wait(monkeypatch, steps):
  """A SIGTERM to this process once the last save (of step `steps`) is finished, while the
  run still waits for it."""
  make = checkpoint.manager

  def manager(*args, **kwargs):
    mngr = make(*args, **kwargs)
    wait = mngr.wait_until_finished

    def wait_then_sigterm():
      wait()
      if mngr.latest_step() == steps:
        os.kill(os.getpid(), signal.SIGTERM)
        mngr.wait_until_finished = wait

    mngr.wait_until_finished = wait_then_sigterm
    return mngr

  monkeypatch.setattr(checkpoint, 'manager', manager)


@pytest.mark.parametrize('moment', ['reading the last losses', 'finishing the last save'])
def test_a_sigterm_after_the_last_steps_check_saves_and_stops_and_a_rerun_resumes(
    tmp_path, monkeypatch, outer_sigterm, straight, moment):
  if moment == 'reading the last losses':
    sigterm_at_last_check(monkeypatch, STEPS)
  else:
    sigterm_in_last_wait(monkeypatch, STEPS)
  with pytest.raises(train.Preempted, match=re.escape(f'saved step {STEPS} in {tmp_path}; ')):
    train_tiny(tmp_path)
  assert latest_checkpoint(str(tmp_path)) == STEPS
  assert signal.getsignal(signal.SIGTERM) is outer_sigterm and not outer_sigterm.got
  monkeypatch.undo()
  assert_bitwise_equal(straight, train_tiny(tmp_path))


def test_a_sigterm_in_a_fine_tunes_last_steps_stops_the_quickstart_before_what_follows(
    tiny_run, tmp_path, monkeypatch, outer_sigterm):
  config, finished, _ = tiny_run
  workdir = str(tmp_path / 'workdir')
  shutil.copytree(finished, workdir)
  last = experiment.tasks(config)[-1]
  shutil.rmtree(workdir_lib.finetune_dir(workdir, 'full', last))
  sigterm_at_last_check(monkeypatch, config.finetune.steps)
  evaluated = []
  monkeypatch.setattr(evaluate, 'run', lambda *args: evaluated.append(args))
  with pytest.raises(train.Preempted, match=f'saved step {config.finetune.steps} in '):
    quickstart.run(config, workdir)
  assert not evaluated and not outer_sigterm.got
  assert not os.path.exists(workdir_lib.task_vector_file(workdir, 'full', last))
  monkeypatch.undo()
  # The rerun takes the saved last step: the task vector of the uninterrupted run.
  finetune.run(config, workdir, last, experiment.regime(config, 'full'))
  resumed, _ = checkpoint.load_tree(workdir_lib.task_vector_file(workdir, 'full', last))
  whole, _ = checkpoint.load_tree(workdir_lib.task_vector_file(finished, 'full', last))
  assert_bitwise_equal(tree_lib.flatten(whole), tree_lib.flatten(resumed))


FULL_DISK_JOB = r'''
import errno
import re
from configs import quickstart
from editing.jobs import cli
from orbax.checkpoint._src.path import async_path
from tests import test_train

write_text = async_path.write_text


async def full_after_the_first_save(path, text, *args, **kwargs):
  """Orbax's metadata writes, in its save thread: the disk is full once step 1 is saved."""
  if int(re.search(r'/(\d+)\.orbax-checkpoint-tmp', str(path)).group(1)) > 1:
    raise OSError(errno.ENOSPC, 'No space left on device', str(path))
  return await write_text(path, text, *args, **kwargs)


async_path.write_text = full_after_the_first_save
cli.run(lambda config, workdir: test_train.train_tiny_problem(workdir, %d), quickstart)
'''


def test_a_full_disk_in_orbaxs_save_thread_is_one_line_naming_the_workdir_and_a_rerun_resumes(
    tmp_path, run_python, straight):
  workdir = tmp_path / 'run'
  proc = run_python(['-c', FULL_DISK_JOB % STEPS, f'--workdir={workdir}'], check=False)
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(
      f'error: {workdir}: no space is left on its file system'), proc.stderr
  assert latest_checkpoint(str(workdir)) == 1
  assert_bitwise_equal(straight, train_tiny(workdir))


@pytest.mark.parametrize('error, full', [
    pytest.param(OSError(errno.ENOSPC, 'No space left on device'), True, id='ENOSPC'),
    pytest.param(OSError(errno.EDQUOT, 'Disk quota exceeded'), True, id='EDQUOT'),
    pytest.param(ValueError('RESOURCE_EXHAUSTED: Failed to write 12577 bytes to file 20: No '
                            "space left on device [os_error_code='28']"), True, id='tensorstore'),
    pytest.param(OSError(errno.EACCES, 'Permission denied'), False, id='EACCES'),
    pytest.param(ValueError('RESOURCE_EXHAUSTED: out of memory'), False, id='memory'),
])
def test_a_full_disk_is_found_however_deep_it_is_wrapped(error, full):
  wrapped = RuntimeError('a background save failed')
  wrapped.__cause__ = error
  rewrapped = ValueError('commit failed')
  rewrapped.__context__ = wrapped
  assert checkpoint.is_disk_full(rewrapped) == full
  with pytest.raises(UserError if full else ValueError, match='^/w: no space' if full else
                     'commit failed'):
    with checkpoint.disk_full_named('/w'):
      raise rewrapped
  # Outside training too (a merge's orbax save), a job ends on one line naming its workdir;
  # any other error keeps its traceback.
  line = cli._error_line(rewrapped, '/w')  # pylint: disable=protected-access
  assert (line.startswith('error: /w: no space is left') if full else line is None), line


def test_an_os_error_on_a_known_path_names_that_path():
  line = cli._error_line(  # pylint: disable=protected-access
      OSError(errno.ENOSPC, 'No space left on device', '/w/results.json'), '/w')
  assert line == ('error: /w/results.json: No space left on device; its file system is full; '
                  'free space or choose another path')


def adapter_with(tmp_path, name, **changes):
  """A copy of the peft adapter of the q_proj layers at <tmp_path>/adapter, its config
  changed."""
  directory = tmp_path / name
  shutil.copytree(tmp_path / 'adapter', directory)
  edit_config(directory, **changes)
  return str(directory)


def test_an_adapter_whose_target_modules_leave_out_its_factors_is_refused(tmp_path):
  params, model, _ = clip_setup(tmp_path, r=4, lora_alpha=8, target_modules=['q_proj'])
  family = hf.FAMILIES['clip_vision']
  nowhere = [adapter_with(tmp_path, f'nowhere{i}', target_modules=['query']) for i in range(2)]
  with pytest.raises(ValueError, match='not found in the base model'):
    peft.PeftModel.from_pretrained(test_hf.clip_vision(tmp_path / 'base2'), nowhere[0])
  config_file = os.path.join(nowhere[0], peft_adapter.CONFIG)
  refused = re.escape(f"{config_file}: target_modules ['query'] match none of the modules its "
                      'factors adapt')
  with pytest.raises(UserError, match=f'^{refused}'):
    peft_adapter.read(nowhere[0], family, model, params)
  with pytest.raises(UserError, match=f'^{refused}'):
    checkpoint_job.merge(str(tmp_path / 'base'), nowhere, str(tmp_path / 'merged'),
                         plan_lib.Plan('task_arithmetic', {}))
  assert not os.path.exists(tmp_path / 'merged')
  # Some layers left out (by name, or by exclude_modules): PEFT would drop their factors.
  first = r'vision_model\.encoder\.layers\.0\.self_attn\.q_proj'
  for name, changes in (('named', dict(target_modules=first)),
                        ('excluded', dict(target_modules=['q_proj'], exclude_modules=first))):
    with pytest.raises(UserError, match=r'target_modules .* leave out vision_model\.encoder\.'
                                        r'layers\.[01]\.self_attn\.q_proj, whose factors'):
      peft_adapter.read(adapter_with(tmp_path, name, **changes), family, model, params)
  # PEFT's other forms that take every adapted layer read as before.
  for i, targets in enumerate(('.*q_proj', ['self_attn.q_proj'], 'all-linear')):
    vector = peft_adapter.read(adapter_with(tmp_path, f'every{i}', target_modules=targets),
                               family, model, params)
    assert len(vector.delta) == model['depth']
