"""Shared fixtures. Tests run on the CPU; multi-device tests start their own processes."""

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(args, *, env=None, timeout=600, check=True) -> subprocess.CompletedProcess:
  """Runs `python args...` from the repository root and returns the finished process."""
  full_env = dict(os.environ, **(env or {}))
  full_env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO, full_env.get('PYTHONPATH')]))
  proc = subprocess.run([sys.executable] + list(args), cwd=REPO, env=full_env,
                        capture_output=True, text=True, timeout=timeout)
  if check and proc.returncode:
    raise AssertionError(f'{args} exited {proc.returncode}:\n{proc.stderr[-4000:]}')
  return proc


@pytest.fixture(name='run_python')
def run_python_fixture():
  return run_python


_SHARED_CACHE = 'EDITMERGE_TEST_JAX_CACHE'
# The tests' programs are small and run for moments: compiling them is most of their time, and
# LLVM's machine-code optimisations cost more than they save. XLA's own passes still run.
_COMPILE_FAST = '--xla_backend_optimization_level=0'


def pytest_configure(config):
  """Settings every process of the run inherits (the pytest-xdist workers, and every process a
  test starts): fast compiles, and one persistent XLA compilation cache, so that a program
  that many tests (and their workdirs) build compiles once."""
  del config
  if _COMPILE_FAST not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {_COMPILE_FAST}'.strip()
  if os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    return
  os.environ[_SHARED_CACHE] = tempfile.mkdtemp(prefix='editmerge-jax-cache-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = os.environ[_SHARED_CACHE]
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'


def xla_flags(devices: int) -> str:
  """The run's XLA flags with `devices` CPU devices, for a process a test starts."""
  return f'{os.environ["XLA_FLAGS"]} --xla_force_host_platform_device_count={devices}'


def pytest_unconfigure(config):
  del config
  if os.environ.get('PYTEST_XDIST_WORKER') is None and _SHARED_CACHE in os.environ:
    shutil.rmtree(os.environ.pop(_SHARED_CACHE), ignore_errors=True)
    for name in ('JAX_COMPILATION_CACHE_DIR', 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'):
      os.environ.pop(name, None)


TINY_REGIMES = ('full', 'talos')


def pytest_collection_modifyitems(items):
  """Files in collection order, but those that read the shared `tiny_run`: the quickstart's own
  first, so that a pytest-xdist worker starts that run at once, and the others last, so that no
  worker sits idle waiting for it while files that do not need it are left to run."""
  readers = {item.path for item in items if 'tiny_run' in getattr(item, 'fixturenames', ())}

  def place(item):
    if item.path.name == 'test_quickstart.py':
      return 0
    return 2 if item.path in readers else 1

  items.sort(key=place)  # stable: each file's tests keep their order


@pytest.fixture(scope='session', name='tiny_run')
def tiny_run_fixture(tmp_path_factory, worker_id):
  """(config, workdir, results) of the quickstart on the tiny config in two regimes, run once
  for every test that reads a finished workdir (copy it before changing anything in it). The
  pytest-xdist workers share it: the first to take the lock runs it, the others then rerun it
  on the finished workdir, which reuses every fine-tune."""
  from configs import quickstart as quickstart_config  # pylint: disable=g-import-not-at-top
  from editing.jobs import quickstart  # pylint: disable=g-import-not-at-top
  shared = tmp_path_factory.getbasetemp()
  if worker_id != 'master':
    shared = shared.parent  # the run's directory, above each worker's own
  config = quickstart_config.get_config('tiny')
  config.regimes = ','.join(TINY_REGIMES)
  workdir = str(shared / 'quickstart_tiny')
  with open(shared / 'quickstart_tiny.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    return config, workdir, quickstart.run(config, workdir)


@pytest.fixture(scope='session', name='smollm2_gguf')
def smollm2_gguf_fixture():
  """The path of SmolLM2-135M-Instruct.Q4_1.gguf, fetched into the cache on first use. A test
  that needs it and cannot have it fails with the one line saying why; it does not skip."""
  from editing.errors import UserError  # pylint: disable=g-import-not-at-top
  from editing.models import smollm2  # pylint: disable=g-import-not-at-top
  try:
    return smollm2.gguf_path()
  except UserError as e:
    pytest.fail(str(e), pytrace=False)
