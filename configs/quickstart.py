r"""The built-in suite end to end: pretrain, fine-tune every task, add and negate task vectors.

  python -m launch.quickstart                                  # about 8.5 minutes on 2 CPU cores
  python -m launch.quickstart --config=configs/quickstart.py:tiny --workdir=/tmp/tiny
  python -m launch.quickstart --config.finetune.steps=300 --workdir=workdir/longer
  python -m launch.quickstart --config.regimes=full,attention_only,linearized,talos

`pretrain`, `finetune` and `evaluate` read the same config, so each step can also be run alone:

  python -m launch.pretrain --workdir=workdir/quickstart
  python -m launch.finetune --workdir=workdir/quickstart --task=digits
  python -m launch.evaluate --workdir=workdir/quickstart

The argument 'tiny' shrinks model, data and steps to a seconds-long run for tests.
"""

import ml_collections

from editing import settings
from editing.data import suite
from editing.data import triggers
from editing.jobs import evaluate
from editing.jobs import finetune
from editing.jobs import pretrain
from editing.regimes import lora
from editing.regimes import talos


def training(**overrides) -> ml_collections.ConfigDict:
  """The optimizer and loop settings `editing.train.train` reads, at the defaults
  `editing.jobs.finetune.TRAINING` declares but for `overrides`."""
  config = settings.defaults(finetune.TRAINING)
  config.update(overrides)
  return config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The encoder: a CLIP-layout ViT. Defaults: 0.83M params, 4x4 patches of 8x8 pixels.
  config.model = ml_collections.ConfigDict(dict(
      patch_size=8, width=128, depth=4, num_heads=4, mlp_dim=512, embed_dim=128,
      dtype='float32'))

  # The offline suite (editing/data/suite.py). Tasks are comma-separated.
  config.suite = ml_collections.ConfigDict(dict(
      seed=0,
      tasks=','.join(suite.DOWNSTREAM_TASKS),
      train_size=5000,
      test_size=1000,
      val_fraction=0.1,
      pretrain_size=25000,
  ))

  # Frozen task heads: centred class means of pretrained embeddings (editing/models/head.py),
  # cosine logits times this scale.
  config.head = ml_collections.ConfigDict(dict(logit_scale=30.0))

  # Pretraining (editing/jobs/pretrain.py) on `corpus`: 'captions' (`corpus_size` captioned
  # scenes, editing/data/captions.py) or 'shapes' (the control task), with a cosine head learned
  # jointly and then discarded; a learned head trains faster at a small logit scale. These
  # defaults are the settings of the backbone the project ships (editing/data/backbone/): it
  # is used, its hash verified, unless `from_scratch` asks to pretrain with the settings given.
  config.pretrain = settings.defaults(pretrain.PRETRAIN)
  config.pretrain.update(steps=30_000, batch_size=256, learning_rate=1e-3, weight_decay=0.05,
                         warmup_steps=500, checkpoint_every=1000, log_every=100)

  # Fine-tuning one task on its frozen head, in every regime listed (comma-separated) of
  # full, attention_only, linearized, talos, lora, l_lora (editing/regimes/).
  config.finetune = training(steps=100, learning_rate=1e-4, weight_decay=0.1, warmup_steps=10)
  config.regimes = 'full'

  # TaLoS (editing/regimes/talos.py): the kept fraction k, the pruning rounds R, and the chunk
  # of per-example gradients scored at once.
  config.talos = settings.defaults(talos.TALOS)

  # LoRA and L-LoRA (editing/regimes/lora.py): the rank r, α of the scale α/r (α/√r with
  # rslora), and the kernels adapted, a regex over leaf paths (PEFT's default: query, value).
  for name in ('lora', 'l_lora'):
    config[name] = settings.defaults(lora.LORA)

  # Backdoor poisoning (editing/data/triggers.py): each task listed (comma-separated; empty:
  # none) is fine-tuned on its training set with a share `rate` of the examples carrying the
  # trigger and relabeled `target`, chosen by `seed`. A trigger's settings are its section.
  config.poison = settings.defaults(triggers.POISON)
  for name, trigger in triggers.REGISTRY.items():
    config[name] = settings.defaults(trigger)

  # The α grid is 0, alpha_step, ..., 1. Negation checks the control task at every α of every
  # task, so its validation set is capped (the pretraining corpus's own is much larger).
  # Weight disentanglement ξ runs on task pairs 'a:b,c:d' (empty: consecutive pairs of
  # suite.tasks) over linspace(-limit, limit, points)², on the first `size` test images of each.
  # These sizes keep the quickstart's evaluation near three minutes on two CPU cores
  # (docs/speed.md): a 0.1 step for α, ξ every 0.5 on 128 images per task (two tasks' images
  # fill one batch of 256).
  # (The defaults editing/jobs/evaluate.py declares.)
  config.eval = settings.defaults(evaluate.EVAL)

  # launch.benchmark: `job` 'regimes' times the fine-tuning step of every regime on one batch
  # of `task` (its data, θ0 and head drawn from `seed`), or of random images of `image_size`
  # pixels when it is not 0, over `steps` steps after compiling, with MFU against
  # `peak_flops` per device (0: a known accelerator's bf16 peak), beside PyTorch's eager step
  # (`torch`, on a CPU with torch installed), and the evaluator's throughput on `eval_batches`
  # batches against the bare forward pass; 'merge_checkpoints' times the streaming
  # checkpoint merges of `recipes` (all: ''; merging/jobs/checkpoint_benchmark.py's cases)
  # against the I/O floor, each at most `runs` times (0: its case's count), on a `fixture`
  # ('' or 'benchmark': 136M parameters; 'llama_1b': Llama-3.2-1B's shapes in bfloat16;
  # 'tiny'); 'mergekit' runs `recipes` (all: '') through the `mergekit` command given and
  # editmerge on a `fixture` of the same ('' is 'tiny' there), and compares them.
  config.benchmark = ml_collections.ConfigDict(dict(job='regimes', task='colour', seed=0,
                                                    steps=20, image_size=0, peak_flops=0.0,
                                                    torch=True, eval_batches=4,
                                                    mergekit='', recipes='', fixture='',
                                                    runs=0))

  # Devices: 0 means all visible ones, on a (data, fsdp, tensor) mesh whose data axis takes
  # what fsdp × tensor leave. Params are placed by the logical-axis rules of `preset` ('dp'
  # replicates, 'fsdp', 'fsdp+tp'; editing/sharding.py), after any (regex, partition spec)
  # override in sharding_rules, first match wins.
  config.num_devices = 0
  config.sharding = ml_collections.ConfigDict(dict(preset='dp', fsdp=1, tensor=1))
  config.sharding_rules = []

  if arg == 'tiny':
    config.model.update(patch_size=8, width=32, depth=2, num_heads=2, mlp_dim=64, embed_dim=32)
    config.suite.update(tasks='digits,colour,size', train_size=400, test_size=128,
                        pretrain_size=800)
    config.pretrain.update(steps=20, batch_size=32, warmup_steps=2, checkpoint_every=10,
                           log_every=10, corpus='shapes', corpus_size=2000, from_scratch=True)
    config.finetune.update(steps=12, batch_size=32, learning_rate=1e-3, warmup_steps=2,
                           checkpoint_every=6, log_every=6)
    config.talos.update(batch_size=8)
    config.eval.update(batch_size=64, alpha_step=0.25, disentanglement_points=3,
                       disentanglement_size=24,
                       linearity_alphas='')  # tests/test_linearity.py runs it
  elif arg:
    raise ValueError(f'unknown config argument {arg!r}; use none or "tiny"')
  return config
