"""Runs over several processes (hosts): one JAX program, every device of every host in one mesh.

Each host runs the same command. `initialize` joins them (`jax.distributed`); after that
`jax.devices()` lists every host's devices and the meshes of editing.sharding span them all.
Every process computes the same thing on its own devices, so the rules are few:

- Input: every process reads only the batch rows its own devices hold (`global_batch`).
- Output to the host: an array split across processes is gathered before it is read
  (`to_host`), since a process can fetch only its own devices' shards.
- Files: process 0 writes, and every process waits at the end of each write until it is done
  (`editing.atomic.file`), so no process reads a file another has not finished. The
  workdir must be on a filesystem every host sees (NFS, a gcsfuse mount). Orbax writes the
  training checkpoints itself, each process its own shards.
- Console: the launch jobs log and print on process 0 only (`editing.jobs.cli`).

With one process every function here is its single-host self.
"""

import zlib
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from editing.errors import UserError

PyTree = Any


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """Joins this process to the others of a multi-process run.

  On a TPU pod slice, under SLURM or Open MPI, JAX finds all three arguments itself; elsewhere
  (several GPU hosts, processes on one machine) pass them, the same address and count to
  every process. CPU devices talk over gloo, so the same run works without accelerators.
  """
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  try:
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  except (ValueError, TypeError) as e:
    raise UserError(f'a multi-process run could not start: {e} (pass --coordinator_address, '
                    '--num_processes and --process_id where JAX cannot detect the cluster)')


def is_primary() -> bool:
  """Whether this process writes files and the console (process 0)."""
  return jax.process_index() == 0


def sync(name: str) -> None:
  """Waits until every process gets here; a no-op in a single process."""
  if jax.process_count() > 1:
    # The barrier's name must be short and the same on every process.
    multihost_utils.sync_global_devices(f'editmerge {zlib.crc32(name.encode()):08x}')


def to_host(tree: PyTree) -> PyTree:
  """numpy copies of a tree's arrays, gathering those split across processes (every process
  must call it, in the same order)."""
  def fetch(leaf):
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))
  return jax.tree.map(fetch, tree)


def local_rows(sharding: jax.sharding.Sharding, size: int) -> np.ndarray:
  """The sorted rows of a `size`-row batch that this process's devices hold under `sharding`."""
  rows = np.arange(size)
  held = [rows[index[0]] for index in sharding.addressable_devices_indices_map((size,)).values()]
  return np.unique(np.concatenate(held))


def global_batch(read: Callable[[np.ndarray], Sequence[np.ndarray]], indices: np.ndarray,
                 sharding: jax.sharding.Sharding) -> list[jax.Array]:
  """The batch of dataset rows `indices`, as global arrays split by `sharding` over the batch
  axis, of which this process reads (`read(rows) -> arrays`) only the rows its devices hold."""
  mine = local_rows(sharding, len(indices))
  arrays = read(np.asarray(indices)[mine])
  if len(mine) == len(indices):
    return [jax.device_put(a, sharding) for a in arrays]
  position = np.full(len(indices), -1)
  position[mine] = np.arange(len(mine))
  return [jax.make_array_from_callback(
      (len(indices),) + a.shape[1:], sharding,
      lambda index, a=a: a[position[np.arange(len(indices))[index[0]]]]) for a in arrays]

