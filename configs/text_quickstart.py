r"""The built-in text suite end to end: a small pretrained decoder fine-tuned on every task, and
task vectors added and negated, exact match throughout.

  python -m launch.quickstart --config=configs/text_quickstart.py --workdir=workdir/text
  python -m launch.quickstart --config=configs/text_quickstart.py:tiny --workdir=/tmp/text_tiny
  python -m launch.quickstart --config=configs/text_quickstart.py \
      --config.regimes=full,attention_only,linearized,talos,lora,l_lora --workdir=workdir/text

The same jobs run it as they run the image suite's (configs/quickstart.py), step by step too:

  python -m launch.pretrain --config=configs/text_quickstart.py --workdir=workdir/text
  python -m launch.finetune --config=configs/text_quickstart.py --workdir=workdir/text --task=add
  python -m launch.evaluate --config=configs/text_quickstart.py --workdir=workdir/text
  python -m launch.merge --config=configs/merge.py:text --workdir=workdir/text
  python -m launch.export --config=configs/text_quickstart.py --workdir=workdir/text \
      --config.export.output=/models/text-task-arithmetic

The argument 'tiny' shrinks the data and steps (not the shipped decoder) to a run of seconds
for tests.
"""

import ml_collections

from configs import quickstart
from editing import settings
from editing.data import text_suite
from editing.jobs import evaluate
from editing.jobs import pretrain
from editing.regimes import lora
from editing.regimes import talos


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The decoder, as the fields of a Hugging Face config.json: a 4-layer Llama of 0.8M params
  # over the suite's characters (editing.models.tokenizer.characters: 4 special tokens and
  # text_suite.ALPHABET), its embedding tied to the output.
  config.model = ml_collections.ConfigDict(dict(
      model_type='llama', vocab_size=4 + len(text_suite.ALPHABET), hidden_size=128,
      intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
      tie_word_embeddings=True, dtype='float32'))

  # The text suite (editing/data/text_suite.py). Tasks are comma-separated; `length` is every
  # row's tokens, BOS + prompt + answer + EOS, padded.
  config.suite = settings.defaults(text_suite.SETTINGS)
  config.suite.update(tasks=','.join(text_suite.DOWNSTREAM_TASKS), train_size=4000,
                      val_size=200, test_size=400)

  # Pretraining on the suite's mixture (every task at easier spans, and general text), as
  # language modelling. These are the settings of the decoder the project ships
  # (editing/data/backbone/decoder_mixture.*): it is used, its hash verified, unless
  # `from_scratch` asks to pretrain with the settings given.
  config.pretrain = settings.defaults(pretrain.PRETRAIN)
  config.pretrain.update(corpus='mixture', corpus_size=200_000, steps=4000, batch_size=128,
                         learning_rate=3e-3, weight_decay=0.1, warmup_steps=200,
                         checkpoint_every=500, log_every=100)

  # Fine-tuning one task on its answers' tokens, in every regime listed (comma-separated) of
  # full, attention_only, linearized, talos, lora, l_lora (editing/regimes/).
  config.finetune = quickstart.training(steps=100, batch_size=64, learning_rate=1e-3,
                                        weight_decay=0.0, warmup_steps=10, checkpoint_every=50,
                                        log_every=20)
  config.regimes = 'full'
  config.talos = settings.defaults(talos.TALOS)
  for name in ('lora', 'l_lora'):
    config[name] = settings.defaults(lora.LORA)

  # The protocols of editing/jobs/evaluate.py, exact match of answers in place of accuracy.
  # Negation's control is the likelihood of held-out general text, exp(mean log p) = 1 /
  # perplexity: keeping 1/1.1 of it is keeping perplexity within +10%. ξ on a 5×5 grid of 64
  # test prompts per task keeps the evaluation near two minutes on two CPU cores.
  config.eval = settings.defaults(evaluate.EVAL)
  config.eval.update(batch_size=256, negation_threshold=0.9091, control_val_size=200,
                     disentanglement_points=5, disentanglement_size=64)

  # launch.export: the merge of `method` in `regime` (launch.merge) to a Hugging Face
  # directory with its tokenizer, which transformers and launch.evaluate_checkpoint read.
  # `task`: '' for the merge; a task's name for its fine-tune θ0 + τ; 'pretrained' for θ0.
  # `answers`: a directory to write the tasks to as jsonl (test.jsonl for exact match,
  # train.jsonl for calibration), for the checkpoint jobs.
  config.export = ml_collections.ConfigDict(dict(regime='full', method='task_arithmetic',
                                                 task='', output='', answers='',
                                                 shard_bytes=2 * 1024**3))

  config.num_devices = 0
  config.sharding = ml_collections.ConfigDict(dict(preset='dp', fsdp=1, tensor=1))
  config.sharding_rules = []

  if arg == 'tiny':
    # The shipped decoder itself, on few examples of three tasks that it half solves and
    # fine-tuning solves in tens of steps (docs/text_suite.md), so that each effect shows.
    config.suite.update(tasks='reverse,sort,cipher', train_size=256, val_size=48, test_size=64)
    config.finetune.update(steps=30, batch_size=32, warmup_steps=3, checkpoint_every=15,
                           log_every=15)
    config.talos.update(batch_size=8)
    config.eval.update(batch_size=64, alpha_step=0.25, control_val_size=48,
                       disentanglement_points=3, disentanglement_size=16,
                       linearity_alphas='')  # tests/test_linearity.py runs it
  elif arg:
    raise ValueError(f'unknown config argument {arg!r}; use none or "tiny"')
  return config
