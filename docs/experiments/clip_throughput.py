"""CPU throughput of CLIP ViT-B/32 full fine-tuning: editmerge (JAX) against transformers'
PyTorch CLIPVisionModelWithProjection, in one process, steps interleaved.

  python docs/experiments/clip_throughput.py [--batch=16] [--steps=5] [--out=result.json]

Both sides start from the same weights (a randomly initialised ViT-B/32 in transformers' layout,
imported into editmerge as a real checkpoint would be), see the same batch of 224 px images, and
take the same step: a frozen 10-class head at logit scale 100 over normalised embeddings,
cross-entropy, global-norm clipping at 1, AdamW at lr 1e-5 with weight decay 0.1. editmerge's
step is the one `editing.train` compiles for the full regime. Needs torch and transformers (the
test extras); PyTorch runs on as many threads as JAX has CPU cores.
"""

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np
import torch
import transformers

from editing import regimes
from editing import train
from editing.jobs import experiment
from editing.models import head as head_lib
from editing.models import hf
from configs import clip_8task

VIT_B32 = dict(hidden_size=768, intermediate_size=3072, projection_dim=512,
               num_hidden_layers=12, num_attention_heads=12, image_size=224, patch_size=32,
               hidden_act='quick_gelu', layer_norm_eps=1e-5)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  torch.set_num_threads(os.cpu_count())
  torch.manual_seed(0)
  theirs = transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig(**VIT_B32))
  with tempfile.TemporaryDirectory() as directory:
    theirs.save_pretrained(directory)
    params, model = hf.load(directory, 'clip_vision')
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(args.batch, 224, 224, 3)).astype(np.float32)
  labels = rng.integers(0, 10, args.batch).astype(np.int32)
  head = rng.standard_normal((10, 512)).astype(np.float32)

  config = clip_8task.get_config('vit_b32')
  config.finetune.batch_size = args.batch
  _, apply_fn = experiment.model(model)
  regime = regimes.get('full')
  encoder = regime.encoder(apply_fn)
  prepared = train.prepare(config.finetune,
                           loss_fn=head_lib.frozen_head_loss(encoder, config.head.logit_scale),
                           params=params, trainable=regime.trainable(params),
                           consts={'theta0': params, 'head': head}, mesh=experiment.mesh(config),
                           sharding_rules=experiment.sharding_rules(config))
  placed = jax.device_put((images, labels), prepared.batch_sharding)
  state = prepared.state

  theirs.train()
  optimizer = torch.optim.AdamW(theirs.parameters(), lr=config.finetune.learning_rate,
                                weight_decay=config.finetune.weight_decay)
  mean = torch.tensor(model['pixel_mean']).view(1, 3, 1, 1)
  std = torch.tensor(model['pixel_std']).view(1, 3, 1, 1)
  pixels = (torch.from_numpy(images.transpose(0, 3, 1, 2)) - mean) / std
  targets = torch.from_numpy(labels).long()
  weights = torch.nn.functional.normalize(torch.from_numpy(head), dim=-1)

  def torch_step():
    optimizer.zero_grad()
    embeds = torch.nn.functional.normalize(theirs(pixel_values=pixels).image_embeds, dim=-1)
    loss = torch.nn.functional.cross_entropy(config.head.logit_scale * embeds @ weights.T,
                                             targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(theirs.parameters(), config.finetune.grad_clip)
    optimizer.step()
    return loss.item()

  timings = {'editmerge': [], 'pytorch': []}
  for _ in range(args.steps + 1):  # the first step of each compiles or warms up; not counted
    start = time.perf_counter()
    state, metrics = prepared.step(state, prepared.inputs, *placed)
    jax.block_until_ready(metrics['loss'])
    timings['editmerge'].append(time.perf_counter() - start)
    start = time.perf_counter()
    torch_step()
    timings['pytorch'].append(time.perf_counter() - start)
  step_s = {k: float(np.median(v[1:])) for k, v in timings.items()}
  result = {'batch': args.batch, 'steps': args.steps, 'cpus': os.cpu_count(),
            'torch_threads': torch.get_num_threads(), 'median_step_s': step_s,
            'images_per_s': {k: args.batch / v for k, v in step_s.items()},
            'editmerge_speed_over_pytorch': step_s['pytorch'] / step_s['editmerge']}
  print(json.dumps(result, indent=1))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)


if __name__ == '__main__':
  main()
