"""Device meshes and partition rules.

Parameters are placed by config data, big_vision style: a list of (regex, spec) pairs matched
against each leaf's '/'-joined path, first match wins, where spec is a tuple of mesh-axis names
(or None) per array dimension; an empty tuple replicates. Batches are split along 'data'. The
same code runs on a 1-device laptop mesh, N simulated CPU devices, a GPU or a TPU slice.
"""

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from editing import tree as tree_lib
from editing.errors import UserError

DATA_AXIS = 'data'
REPLICATED_RULES = (('.*', ()),)


def make_mesh(num_devices: int | None = None) -> Mesh:
  """A 1-D data-parallel mesh over the first `num_devices` devices (all when None)."""
  devices = jax.devices()
  if num_devices is not None:
    if not 0 < num_devices <= len(devices):
      raise UserError(f'num_devices={num_devices}, but {len(devices)} devices are visible')
    devices = devices[:num_devices]
  return Mesh(np.asarray(devices), (DATA_AXIS,))


def param_shardings(mesh: Mesh, params: Any,
                    rules: Sequence[tuple[str, Sequence[str | None]]] = REPLICATED_RULES) -> Any:
  """A NamedSharding per leaf, from the first rule whose regex matches the leaf's path."""
  def sharding(path, leaf):
    spec = tuple(tree_lib.first_match(path, rules))
    if len(spec) > np.ndim(leaf):
      raise UserError(f'sharding rule {spec} for {path} has more axes than its shape '
                       f'{np.shape(leaf)}')
    return NamedSharding(mesh, PartitionSpec(*spec))
  return tree_lib.map_with_path(sharding, params)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over 'data'."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def check_batch_size(mesh: Mesh, batch_size: int, what: str = 'batch_size') -> None:
  if batch_size % mesh.shape[DATA_AXIS]:
    raise UserError(f'{what}={batch_size} is not divisible by the {mesh.shape[DATA_AXIS]} '
                     f'devices of the data axis')
