#!/usr/bin/env bash
# On one accelerator: the fine-tuning step of every regime, with MFU (the suite's model, then
# ViT-B/16- and ViT-L/14-shaped image towers at 224 px in bf16, random weights and images),
# then checkpoint merges of a Llama-3.2-1B-shaped bf16 fixture (9.9 GB written once) against
# the I/O floor, with their GB/s and where each merge's time goes (read, to_device, compute,
# from_device, write). About 15 minutes on one H100/H200; prints each table and leaves the
# .json files in ${WORKDIR:-/tmp/editmerge_benchmark}/{suite,vit_b16,vit_l14,merges}.
#
# DRY_RUN=1 runs the merges alone, on the tiny fixture, once each: seconds on a CPU, to check
# the script before device time is spent on it.
set -euo pipefail
WORKDIR=${WORKDIR:-/tmp/editmerge_benchmark}
MERGES=${MERGES:-task_arithmetic,ties,dare_ties,della,model_stock,slerp,karcher}
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  python -m launch.benchmark --workdir="$WORKDIR/merges" --config.benchmark.job=merge_checkpoints \
    --config.benchmark.fixture=tiny --config.benchmark.runs=1 --config.benchmark.recipes="$MERGES"
  exit 0
fi
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
python -m launch.benchmark --workdir="$WORKDIR/merges" --config.benchmark.job=merge_checkpoints \
  --config.benchmark.fixture=llama_1b --config.benchmark.runs=2 --config.benchmark.recipes="$MERGES"
