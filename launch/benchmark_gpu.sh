#!/usr/bin/env bash
# The fine-tuning step of every regime on one accelerator, with MFU: the suite's model, then
# ViT-B/16- and ViT-L/14-shaped image towers at 224 px in bf16 (random weights and images).
# About 5 minutes on one H100/H200; prints each table and leaves benchmark.json files in
# ${WORKDIR:-/tmp/editmerge_benchmark}/{suite,vit_b16,vit_l14}.
set -euo pipefail
WORKDIR=${WORKDIR:-/tmp/editmerge_benchmark}
common=(--config.benchmark.steps=10)
python -m launch.benchmark "${common[@]}" --workdir="$WORKDIR/suite"
python -m launch.benchmark "${common[@]}" --workdir="$WORKDIR/vit_b16" \
  --config.benchmark.image_size=224 --config.finetune.batch_size=128 \
  --config.model.patch_size=16 --config.model.width=768 --config.model.depth=12 \
  --config.model.num_heads=12 --config.model.mlp_dim=3072 --config.model.embed_dim=512 \
  --config.model.dtype=bfloat16
python -m launch.benchmark "${common[@]}" --workdir="$WORKDIR/vit_l14" \
  --config.benchmark.image_size=224 --config.finetune.batch_size=64 \
  --config.model.patch_size=14 --config.model.width=1024 --config.model.depth=24 \
  --config.model.num_heads=16 --config.model.mlp_dim=4096 --config.model.embed_dim=768 \
  --config.model.dtype=bfloat16 --config.talos.batch_size=8
