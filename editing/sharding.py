"""Device meshes and partition rules.

The mesh has three axes, ('data', 'fsdp', 'tensor'), each of size 1 where unused. Batches are
split over data × fsdp. Parameters are placed by config data, big_vision style: a list of
(regex, spec) pairs matched against each leaf's '/'-joined path, first match wins, where spec
is a tuple of mesh-axis names (or None) per array dimension; an empty tuple replicates.

Most rules come from logical axes, as in MaxText: `LOGICAL_AXES` names each dimension of the
models' leaves (embed, heads, kv_heads, head_dim, mlp, vocab), and a preset maps logical names
to mesh axes: 'dp' replicates every parameter, 'fsdp' splits the embedding dimension over
'fsdp', and 'fsdp+tp' also splits heads, MLP and vocabulary over 'tensor'. A dimension that
its mesh axes do not divide stays whole. The same code runs on a 1-device laptop mesh, N
simulated CPU devices, a GPU or a TPU slice.
"""

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from editing import tree as tree_lib
from editing.errors import UserError

DATA_AXIS = 'data'
MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')
REPLICATED_RULES = (('.*', ()),)

# Each dimension of the models' leaves (editing/models: ViT, CLIP text, BERT, the decoder), by
# path. Key and value projections have kv_heads heads: fewer than the query's in a decoder's
# grouped-query attention, as many in an encoder's (so the presets map kv_heads as heads).
LOGICAL_AXES = (
    (r'(.*/)?attn/(key|value)/kernel$', ('embed', 'kv_heads', 'head_dim')),
    (r'(.*/)?attn/(key|value)/bias$', ('kv_heads', 'head_dim')),
    (r'blocks_\d+/mlp/(experts_\d+/)?(gate|up)/kernel$', ('embed', 'mlp')),
    (r'blocks_\d+/mlp/(gate|up)/bias$', ('mlp',)),
    (r'blocks_\d+/mlp/(experts_\d+/)?down/kernel$', ('mlp', 'embed')),
    (r'blocks_\d+/mlp/router/kernel$', ('embed', None)),
    (r'embed/embedding$', ('vocab', 'embed')),
    (r'lm_head/kernel$', ('embed', 'vocab')),
    (r'(.*/)?attn/query/kernel$', ('embed', 'heads', 'head_dim')),
    (r'(.*/)?attn/query/bias$', ('heads', 'head_dim')),
    (r'(.*/)?attn/out/kernel$', ('heads', 'head_dim', 'embed')),
    (r'(.*/)?mlp_fc/kernel$', ('embed', 'mlp')),
    (r'(.*/)?mlp_fc/bias$', ('mlp',)),
    (r'(.*/)?mlp_proj/kernel$', ('mlp', 'embed')),
    (r'(.*/)?patch_embed/kernel$', (None, None, None, 'embed')),
    (r'(.*/)?token_embedding/embedding$', ('vocab', 'embed')),
    (r'(.*/)?position_embedding(/embedding)?$', (None, 'embed')),
    (r'(.*/)?(proj|pooler)/kernel$', ('embed', None)),
    (r'.*', ()),
)
# Logical axis -> mesh axis, per preset; a logical axis a preset does not name is replicated.
PRESETS = {
    'dp': {},
    'fsdp': {'embed': 'fsdp'},
    'fsdp+tp': {'embed': 'fsdp', 'heads': 'tensor', 'kv_heads': 'tensor', 'mlp': 'tensor',
                'vocab': 'tensor'},
}


def make_mesh(num_devices: int | None = None, fsdp: int = 1, tensor: int = 1) -> Mesh:
  """A (data, fsdp, tensor) mesh over the first `num_devices` devices (all when None); the
  data axis takes what fsdp × tensor leaves.

  `jax.devices()` lists the devices process by process, so in a multi-process run each
  process's devices are consecutive along the batch axes (data, then fsdp): each reads one
  contiguous share of a batch, and tensor-parallel groups stay within a host.
  """
  devices = jax.devices()
  if num_devices is not None:
    if not 0 < num_devices <= len(devices):
      raise UserError(f'num_devices={num_devices}, but {len(devices)} devices are visible')
    if num_devices < len(devices) and jax.process_count() > 1:
      raise UserError(f'num_devices={num_devices}: a multi-process run meshes all '
                      f'{len(devices)} devices of its {jax.process_count()} processes')
    devices = devices[:num_devices]
  if fsdp < 1 or tensor < 1 or len(devices) % (fsdp * tensor):
    raise UserError(f'a mesh of fsdp={fsdp} × tensor={tensor} does not divide the '
                    f'{len(devices)} devices')
  shape = (len(devices) // (fsdp * tensor), fsdp, tensor)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_rules(preset: str) -> list[tuple[str, tuple[str | None, ...]]]:
  """`LOGICAL_AXES` as (regex, mesh spec) rules under `preset`."""
  if preset not in PRESETS:
    raise UserError(f'sharding preset {preset!r}: must be one of {sorted(PRESETS)}')
  mapping = PRESETS[preset]
  return [(regex, tuple(mapping.get(name) if name else None for name in names))
          for regex, names in LOGICAL_AXES]


def param_shardings(mesh: Mesh, params: Any,
                    rules: Sequence[tuple[str, Sequence[str | None]]] = REPLICATED_RULES) -> Any:
  """A NamedSharding per leaf, from the first rule whose regex matches the leaf's path; a
  dimension its mesh axes do not divide is left whole."""
  def sharding(path, leaf):
    shape = tuple(getattr(leaf, 'shape', np.shape(leaf)))
    spec = tuple(tree_lib.first_match(path, rules))
    if len(spec) > len(shape):
      raise UserError(f'sharding rule {spec} for {path} has more axes than its shape {shape}')
    spec = tuple(axis if axis is None or shape[d] % _size(mesh, axis) == 0 else None
                 for d, axis in enumerate(spec))
    return NamedSharding(mesh, PartitionSpec(*spec))
  return tree_lib.map_with_path(sharding, params)


def sharded_initializer(init_fn, mesh: Mesh, rules, *args):
  """init_fn (e.g. a flax module's init), jitted to write its leaves for `args` directly into
  the shardings the rules give them: no device ever holds the whole model."""
  shapes = jax.eval_shape(init_fn, *args)
  return jax.jit(init_fn, out_shardings=param_shardings(mesh, shapes, rules))


def init_sharded(init_fn, mesh: Mesh, rules, *args) -> Any:
  """init_fn(*args), computed sharded (`sharded_initializer`)."""
  return sharded_initializer(init_fn, mesh, rules, *args)(*args)


def _size(mesh: Mesh, axes) -> int:
  names = axes if isinstance(axes, tuple) else (axes,)
  return int(np.prod([mesh.shape[a] for a in names]))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes a batch is split over: data and fsdp, those the mesh has."""
  return tuple(a for a in BATCH_AXES if a in mesh.shape)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over data × fsdp."""
  return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


def batch_devices(mesh: Mesh) -> int:
  """The devices a batch is split over: those of the data and fsdp axes."""
  return _size(mesh, batch_axes(mesh))


def check_batch_size(mesh: Mesh, batch_size: int, what: str = 'batch_size') -> None:
  devices = batch_devices(mesh)
  if batch_size % devices:
    raise UserError(f'{what}={batch_size} is not divisible by the {devices} devices of the '
                    'data and fsdp axes')
