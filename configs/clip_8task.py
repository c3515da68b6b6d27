r"""CLIP on the 8-task benchmark from local disk: the same jobs as the built-in suite.

  python -m launch.quickstart --config=configs/clip_8task.py:vit_b32 \
      --config.weights=/models/clip-vit-base-patch32 --config.data_root=/data/8task \
      --config.data.control=imagenet --workdir=workdir/clip_b32
  python -m launch.finetune --config=configs/clip_8task.py:vit_b32 ... --task=cars
  python -m launch.quickstart --config=configs/clip_8task.py:vit_b32 ... --config.regimes=lora,l_lora
  python -m launch.merge --config=configs/clip_8task.py:vit_b32 ... --config.merge.methods=ties
  python -m launch.safety --config=configs/clip_8task.py:vit_b32 ... --workdir=workdir/clip_safety

`config.weights` is a CLIP directory, Hugging Face's CLIPModel (config.json, safetensors) or
open_clip's (open_clip_config.json, open_clip_model.safetensors), with its tokenizer.json:
θ0 is its image tower, and each dataset's frozen head is zero-shot from its text tower (the
class names in `data.templates`, or per dataset in the JSON file `data.templates_file`,
{"cars": ["a photo of a {}, a type of car.", ...]}). `config.data_root` holds one directory per
dataset, each with train and test splits (and val, else 10% of train is held out) as class
folders, parquet exports or .npz (editing/data/images.py); class names come from the folders or
the parquet export's ClassLabel names. Negation's control (`data.control`, ImageNet in the
papers) is a dataset there too.

The recipe is the task-arithmetic papers': AdamW at lr 1e-5, weight decay 0.1, batch 128, a
cosine schedule after 500 warm-up steps, and per dataset the epochs that make about 2,000
steps on the full training sets (`data.epochs`); the heads use CLIP's logit scale, 100.
The argument chooses the architecture (vit_b32, vit_b16, vit_l14); the weights must be it.
'tiny' is a 2-block model at 32 px for tests.
"""

import ml_collections

from configs import merge
from third_party import hf_clip

DATASETS = 'sun397,cars,resisc45,eurosat,svhn,gtsrb,mnist,dtd'
# Epochs per dataset (Ilharco et al. 2023's budget of about 2,000 steps at batch 128).
EPOCHS = dict(cars=35, dtd=76, eurosat=12, gtsrb=11, mnist=5, resisc45=15, sun397=14, svhn=4)
# (patch, width, depth, heads, mlp, embedding) of OpenAI's CLIP image towers.
VARIANTS = {
    'vit_b32': (32, 768, 12, 12, 3072, 512),
    'vit_b16': (16, 768, 12, 12, 3072, 512),
    'vit_l14': (14, 1024, 24, 16, 4096, 768),
    'tiny': (8, 32, 2, 4, 64, 16),
}


def get_config(arg: str | None = 'vit_b32') -> ml_collections.ConfigDict:
  arg = arg or 'vit_b32'
  if arg not in VARIANTS:
    raise ValueError(f'unknown config argument {arg!r}; use one of {sorted(VARIANTS)}')
  tiny = arg == 'tiny'
  # The merging sections come with the fine-tuning and evaluation ones: every job reads this.
  config = merge.get_config('tiny' if tiny else None)
  del config.suite
  del config.pretrain

  config.weights = ''
  config.data_root = ''
  image_size = 32 if tiny else 224
  patch, width, depth, heads, mlp, embedding = VARIANTS[arg]
  # As editing.models.hf reads it from the checkpoint; importing checks that it is.
  config.model = ml_collections.ConfigDict(dict(
      family='vit', patch_size=patch, width=width, depth=depth, num_heads=heads, mlp_dim=mlp,
      embed_dim=embedding, image_size=image_size, activation='quick_gelu',
      layer_norm_epsilon=1e-5, pixel_mean=list(hf_clip.PIXEL_MEAN),
      pixel_std=list(hf_clip.PIXEL_STD), dtype='float32'))

  config.data = ml_collections.ConfigDict(dict(
      tasks=DATASETS, control='', val_fraction=0.1, seed=0, image_size=image_size,
      templates=('a photo of a {}.',), templates_file='', epochs=dict(EPOCHS)))
  config.head.logit_scale = 100.0
  config.finetune.update(steps=2000, batch_size=128, learning_rate=1e-5, weight_decay=0.1,
                         warmup_steps=500, checkpoint_every=500, log_every=50)
  config.eval.update(batch_size=256, alpha_step=0.05, disentanglement_points=5,
                     disentanglement_size=500)
  config.talos.batch_size = 16
  # --config.regimes=lora,l_lora: L-LoRA's CLIP settings (Tang et al.: r 16, α 32) on the
  # query and value projections.
  for name in ('lora', 'l_lora'):
    config[name].update(rank=16, alpha=32.0)
  # launch.safety (merging/jobs/safety.py): the first n victims (n in poisoned_counts) are
  # fine-tuned poisoned (config.poison) with each trigger, and every method merges them with
  # the clean rest, at the config's own seeds (a run over several is config.sweep.seed, with
  # the seeds of finetune, poison and merge unset). BadNets' patch is the suite's 4 px at 32
  # px, scaled to the image size.
  config.safety = ml_collections.ConfigDict(dict(
      victims='svhn,mnist', poisoned_counts='1,2', triggers='badnets,blended',
      methods='task_arithmetic,ties,dare,adamerging_task,adamerging_layer,dam,dam_shared,'
              'dam_safe,dam_oracle'))
  config.badnets.size = 4 * image_size // 32
  # launch.export: the merge of `method` in `regime` to a Hugging Face directory.
  # `task`: '' for the merge; a task's name for its fine-tune θ0 + τ; 'pretrained' for θ0.
  config.export = ml_collections.ConfigDict(dict(regime='full', method='task_arithmetic',
                                                 task='', output='', shard_bytes=2 * 1024**3))

  if tiny:
    config.data.tasks = ''
    config.data.epochs = ml_collections.ConfigDict()
    config.finetune.update(steps=6, batch_size=8, learning_rate=1e-3, warmup_steps=1,
                           checkpoint_every=3, log_every=3)
    config.eval.update(batch_size=16, alpha_step=0.5, disentanglement_points=2,
                       disentanglement_size=8,
                       linearity_alphas='')  # tests/test_linearity.py runs it
    config.talos.update(batch_size=4, rounds=1)
    for name in ('lora', 'l_lora'):
      config[name].update(rank=4, alpha=8.0)
    config.merge.update(train_examples=8)
    config.safety.update(victims='', poisoned_counts='1', triggers='badnets',
                         methods='task_arithmetic,dam')
  return config
