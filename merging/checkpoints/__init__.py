"""Merging Hugging Face checkpoints of any size, a block at a time, through `merging`'s methods.

A base checkpoint θ0 and N fine-tuned checkpoints of the same architecture (any: an LLM, a ViT)
are read lazily (`editing.models.hf.Checkpoint`: positioned reads of a tensor's entries, never
a whole model). For every tensor name, in sorted order, the N deltas τ_t = θ_t − θ0 (in
float32) become one-leaf task vectors, the configured method merges them (the same function the
suite's merges call; DARE's randomness is keyed by the tensor's name, so the bits depend neither
on order nor on sharding nor on the blocks), and θ0 + λ·τ_m is written in θ0's dtype:

  every data-free method of `merging` (averaging, task_arithmetic, ties, dare, breadcrumbs,
  consensus, magmax, tsv_m, iso_c, iso_cts, wudi, model_stock)
                 θ0 + λ·merge(τ_1..τ_N)
  negation       θ0 − λ·τ_1 (one fine-tuned model)
  extract        τ_1 itself, in float32 (one fine-tuned model)

The package, by concern:
  plan.py      what a merge does (`Plan`), every setting checked before anything is read
  pipeline.py  blocks of `BLOCK` entries read into reused buffers, merged in threads ahead
               of the one being written, written as they come
  ranking.py   what needs a tensor whole before its blocks merge: TIES' and Breadcrumbs' cuts
               (`editing.cuts`), per tensor (a large one a block at a time) or over a whole
               model (TIES' scope 'global')
  tensors.py   how a tensor is merged: a block by one jitted program (one program serves every
               block, so a model compiles once per method and dtype; DARE's draws are keyed
               by the tensor's name and each entry's index, so a block draws what the whole tensor
               would),
               or whole, op by op under its own name (the SVD merges, DARE before a ranking)
  job.py       the job: checks, the lock, the recorded partial output and its resumption

Methods that read data (Fisher, RegMean, AdaMerging, DAM) are refused. The output is a Hugging
Face directory: safetensors shards of at most `shard_bytes` with their index, the base's
config.json and tokenizer files, and the record of the merge (merge_plan.json).
"""

from merging.checkpoints.job import merge, plan_of, run
from merging.checkpoints.plan import Plan, SINGLE_MODEL, methods

__all__ = ['Plan', 'SINGLE_MODEL', 'merge', 'methods', 'plan_of', 'run']
