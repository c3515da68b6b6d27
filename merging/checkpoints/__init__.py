"""Merging Hugging Face checkpoints of any size, a block at a time, through `merging`'s methods.

A base checkpoint θ0 and N fine-tuned checkpoints of the same architecture (any: an LLM, a ViT)
are read lazily (`editing.models.hf.Checkpoint`: positioned reads of a tensor's entries, never
a whole model). For every tensor name, in sorted order, the N deltas τ_t = θ_t − θ0 (in
float32) become one-leaf task vectors, the configured method merges them (the same function the
suite's merges call; random draws are keyed by the tensor's name and each entry's index, so the
bits depend neither on order nor on sharding nor on the blocks), and the result is written:

  every data-free method of `merging` (`methods()`)
                 θ0 + λ·merge(τ_1..τ_N) in θ0's dtype (or config.dtype), or merge(τ_1..τ_N)
                 itself in float32 where the method writes its vector (`Method.writes`:
                 extraction); one-model methods (negation, SLERP, ...) take one
  extract_lora   τ_1 as a PEFT LoRA adapter (`extraction`)

The engine asks each method what it needs (`merging.Method`), never its name: whether it reads
a tensor whole (an SVD, a cosine), whether an entry's merge reads only that entry, and what it
keeps of each vector (`merging.sparsity`): cuts of ranked magnitudes, per-entry draws, norms.

The package, by concern:
  plan.py      what a merge does (`Plan`), every setting checked before anything is read, and
               what its method declares, as the engine reads it
  pipeline.py  blocks of `BLOCK` entries read into reused buffers, merged in threads ahead
               of the one being written, written as they come
  ranking.py   what needs a tensor whole before its blocks merge: the counts of a method's
               cuts (`editing.cuts`), per tensor (a large one a block at a time) or over a
               whole model (scope 'global')
  tensors.py   how a tensor is merged: a block by one jitted program (one program serves every
               block, so a model compiles once per method and dtype; draws are keyed by each
               entry's index, so a block draws what the whole tensor would), or whole, op by
               op under its own name (the SVD merges, a ranking of what draws left)
  layered.py   values that vary by tensor: gradients over the layers, filters by name
  sliced.py    layer ranges of the models merged into the output's layers
  passthrough.py  layer ranges stacked as they are (mergekit's passthrough)
  extraction.py, adapters.py  τ_1 as a PEFT LoRA adapter; a base with an adapter applied
  upscaling.py  dense checkpoints into a Mixtral, Qwen2-MoE or Qwen3-MoE (mergekit-moe's
               recipes)
  calibrated.py  RegMean and RegMean++ of decoders on calibration text, a layer at a time
  vocabulary.py  the embedding rows aligned to one vocabulary (mergekit's tokenizer_source),
               or models whose vocabularies differ refused
  output.py    the one output lifecycle of every writer: the overlap check on real paths, the
               lock, `<output>.partial` with its record, resume, copied files, the card, the
               atomic replace
  digests.py   what a resume checks: a digest of every block the merge read
  job.py       the merge job: its inputs checked, a Recipe (`merging.recipe`) run

Of the methods that read data, RegMean and RegMean++ run on decoders with a calibration text
(`calibrated`); the others (Fisher, AdaMerging, DAM) are refused. The output is a Hugging
Face directory: safetensors shards of at most `shard_bytes` with their index, the base's
config.json and tokenizer files, and the record of the merge (merge_plan.json).
"""

from merging.checkpoints.job import merge, plan_of, run
from merging.checkpoints.plan import Plan, SINGLE_MODEL, methods

__all__ = ['Plan', 'SINGLE_MODEL', 'merge', 'methods', 'plan_of', 'run']
