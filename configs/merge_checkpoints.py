r"""Merging Hugging Face checkpoints, a tensor at a time (merging/checkpoints/).

  python -m launch.merge_checkpoints --config.base=/models/base \
      --config.models=/models/math,/models/code --config.method=ties --config.scale=1.0 \
      --config.output=/models/merged
  python -m launch.merge_checkpoints --config.base=/models/base --config.models=/models/toxic \
      --config.method=negation --config.scale=0.5 --config.output=/models/detoxified

  python -m launch.merge_checkpoints --config.mergekit=merge.yaml --config.output=/models/m

Methods: every data-free method of merging/ (averaging, task_arithmetic, ties (per tensor),
dare, breadcrumbs, consensus, magmax, della, sce, slerp, nuslerp, multislerp, karcher, tsv_m,
iso_c, iso_cts, wudi, model_stock: the same functions the suite's merges call), RegMean and
RegMean++ of decoders on calibration text, a layer at a time (merging/checkpoints/
calibrated.py: --config.method=regmean --config.calibration.file=text.txt), negation
(θ0 − λτ), extract (write τ) and extract_lora (τ as a PEFT LoRA adapter). The weighted ones
take per-model `weights` as mergekit does. A model may be a PEFT LoRA adapter directory (the
base with it merged in); the LoRA-space methods (knots_ties, knots_dare, peft_cat, peft_svd,
... peft_magnitude_prune_svd) take adapters only and write the merge as an adapter:

  python -m launch.merge_checkpoints --config.base=/models/base \
      --config.models=/adapters/a,/adapters/b --config.method=knots_ties --config.output=/a/m

`mergekit` reads a mergekit YAML config (merging/mergekit/reader.py) in place of the flags it
sets; both become one `merging.recipe.Recipe`. The output's README.md records the merge (and
the recipe). `mergekit_moe` reads a mergekit-moe YAML config (merging/mergekit/moe.py) and
upscales its dense Llama or Mistral models into a Mixtral, or Qwen3 ones into a Qwen3-MoE
(merging/checkpoints/upscaling.py):

  python -m launch.merge_checkpoints --config.mergekit_moe=moe.yaml --config.output=/models/moe
"""

import ml_collections

import merging
from editing import settings
from editing.jobs import evaluate_checkpoint
from merging.checkpoints import calibrated
from merging.checkpoints import extraction


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  config = ml_collections.ConfigDict()
  config.base = ''  # a Hugging Face directory or one .safetensors file
  config.models = ''  # the fine-tuned checkpoints, comma-separated
  config.output = ''  # default: <workdir>/merged
  config.overwrite = False  # replace an output that is not this merge's own
  config.method = 'task_arithmetic'
  config.scale = 1.0  # λ in θ0 + λ·τ_m (θ0 − λ·τ for negation)
  config.seed = 0  # DARE's and DELLA's key (mergekit's --random-seed); keyed by tensor name
  config.shard_bytes = 2 * 1024**3
  config.allow_nonfinite = False
  config.weights = ''  # per model, comma-separated, in the order of config.models
  config.dtype = ''  # of the output's floating tensors (float32, bfloat16, float16); '': base's
  config.prefetch = 2  # blocks merged ahead in threads while one is written (up to the cores)
  config.mergekit = ''  # a mergekit YAML config that sets the merge instead of the flags
  config.mergekit_moe = ''  # a mergekit-moe YAML config: dense models upscaled to a MoE
  # Scoring the output beside its inputs once it is written, where a file is given: the
  # sections of configs/evaluate_checkpoint.py (perplexity, multiple_choice, exact_match, scoring).
  config.evaluate = ml_collections.ConfigDict(
      {name: settings.defaults(section) for name, section in evaluate_checkpoint.SECTIONS.items()})
  # Structured values are written in mergekit's notation, YAML's flow style
  # (merging/recipe.py). Values that vary by tensor, {field: value}: a field is a setting of
  # the method, 'scale' or 'weights.<i>'; a value a gradient over the layers or {filter, value}
  # entries (merging/checkpoints/layered.py), e.g. '{t: [0, 0.5, 1]}'; LiNeS with α, β over
  # any method is '{scale: [α, α + β]}'.
  config.layered = ''
  # The output's layers merged from layer ranges of the base and each model (mergekit's slices
  # with a merging method), [{model: [first layer, end layer], ...}, ...], every model and the
  # base in each slice: '[{/m/base: [0, 16], /m/a: [0, 16]}]'. For method 'passthrough', one
  # model a slice, stacked: '[{/m/a: [0, 12]}, {/m/b: [4, 16]}]', each tensor times `scale`
  # (or config.layered's scale).
  config.slices = ''
  # Settings given one value per model, {setting: [values]} in the order of config.models
  # (mergekit's per-model density), for the methods that take them: '{density: [0.2, 0.4]}'.
  config.per_model = ''
  # A merge's vocabulary, every model's embedding rows aligned to it (mergekit's
  # tokenizer_source): 'base', 'union' or a checkpoint's path; '': the base's, every model's
  # being the same. A passthrough's: the checkpoint whose tokenizer files the output takes.
  config.tokenizer = ''
  config.pad_to_multiple_of = 0  # the aligned matrices' rows rounded up to a multiple of it
  # The methods' settings at the defaults merging/<method>.py declares, but that TIES ranks
  # each tensor on its own here, as mergekit does.
  for method, entry in merging.REGISTRY.items():
    if entry.data_free or method in calibrated.METHODS:
      config[method] = merging.defaults(method)
  # The text regmean and regmean_plusplus take their Grams on, in windows read by the base's
  # tokenizer (merging/checkpoints/calibrated.py).
  config.calibration = settings.defaults(calibrated.SETTINGS)
  config.extract_lora = settings.defaults(extraction.options)
  config.ties.scope = config.dare.scope = 'tensor'
  return config
