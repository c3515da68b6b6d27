"""Per-device parameter bytes under each sharding preset, on 8 simulated CPU devices.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python docs/experiments/param_bytes.py [--out=param_bytes.json]

For the suite's ViT and CLIP's ViT-B/16 and ViT-L/14 image towers, the bytes of float32 params
each device holds when `editing.sharding` places them by a preset's logical-axis rules on a
(data, fsdp, tensor) mesh, read from the shardings of shape-only params (nothing is allocated).
AdamW's two moments are placed like the params, so training state is three times these.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from configs import clip_8task
from configs import quickstart
from editing import sharding
from editing.models import vit

# (preset, fsdp, tensor); the data axis takes the rest of the 8 devices.
MESHES = (('dp', 1, 1), ('fsdp', 8, 1), ('fsdp+tp', 4, 2), ('fsdp+tp', 2, 2))


def models() -> dict[str, tuple[ml_collections.ConfigDict, int]]:
  out = {'suite ViT': (quickstart.get_config().model, 32)}
  for name in ('vit_b16', 'vit_l14'):
    config = clip_8task.get_config(name)
    out[name] = (config.model, 224)
  return out


def per_device_bytes(model_config, image_size: int, preset: str, fsdp: int, tensor: int):
  module = vit.build(model_config)
  shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0),
                          jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32))
  mesh = sharding.make_mesh(8, fsdp, tensor)
  shardings = sharding.param_shardings(mesh, shapes, sharding.logical_rules(preset))
  per_device = np.zeros(8, np.int64)
  total = 0
  for shape, placed in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
    nbytes = int(np.prod(shape.shape)) * shape.dtype.itemsize
    total += nbytes
    for device in placed.device_set:
      shard = placed.shard_shape(shape.shape)
      per_device[device.id] += int(np.prod(shard)) * shape.dtype.itemsize
  return total, int(per_device.max())


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  rows = []
  for name, (model_config, image_size) in models().items():
    for preset, fsdp, tensor in MESHES:
      total, largest = per_device_bytes(model_config, image_size, preset, fsdp, tensor)
      rows.append({'model': name, 'preset': preset,
                   'mesh': f'{8 // (fsdp * tensor)}x{fsdp}x{tensor}', 'total_mb': total / 1e6,
                   'per_device_mb': largest / 1e6, 'share': largest / total})
  print('| model | preset | mesh (data×fsdp×tensor) | params MB | per device MB | share |')
  print('|---|---|---|---:|---:|---:|')
  for r in rows:
    print(f"| {r['model']} | {r['preset']} | {r['mesh']} | {r['total_mb']:.1f} | "
          f"{r['per_device_mb']:.2f} | {r['share']:.3f} |")
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(rows, f, indent=2)


if __name__ == '__main__':
  main()
