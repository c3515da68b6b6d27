r"""The decoder language model benchmark (`editing.jobs.decoder_benchmark`): forward pass,
training step and generation, against transformers' PyTorch eager on a CPU and against the
device's peak on an accelerator.

  python -m launch.benchmark --config=configs/decoder_benchmark.py            # SmolLM2-135M
  python -m launch.benchmark --config=configs/decoder_benchmark.py:llama_1b \
      --config.benchmark.dtype=bfloat16 --config.benchmark.batch_size=8       # on a GPU
  python -m launch.benchmark --config=configs/decoder_benchmark.py:tiny       # seconds, tests

The model is a config.json's fields; its weights are random (they do not change the time).
"""

import ml_collections

# SmolLM2-135M's config.json (a Llama), less the fields that only name files and tokens.
SMOLLM2_135M = dict(
    model_type='llama', architectures=['LlamaForCausalLM'], vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, hidden_act='silu')
# Llama-3.2-1B's shapes (its llama3 RoPE scaling changes no cost, and is left out).
LLAMA_1B = dict(
    model_type='llama', architectures=['LlamaForCausalLM'], vocab_size=128256, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=True, hidden_act='silu')
TINY = dict(SMOLLM2_135M, vocab_size=256, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MODELS = {'smollm2_135m': SMOLLM2_135M, 'llama_1b': LLAMA_1B, 'tiny': TINY}


def get_config(arg: str = 'smollm2_135m') -> ml_collections.ConfigDict:
  """`arg`: one of MODELS."""
  if arg not in MODELS:
    raise ValueError(f'configs/decoder_benchmark.py:{arg}: known {sorted(MODELS)}')
  config = ml_collections.ConfigDict()
  config.benchmark = ml_collections.ConfigDict(dict(
      job='decoder',
      model=ml_collections.ConfigDict(MODELS[arg]),
      dtype='float32',  # of the compute; params and optimizer state stay float32
      remat=False,  # recompute each layer in the backward pass (training memory)
      batch_size=2 if arg == 'tiny' else 4,
      length=16 if arg == 'tiny' else 256,  # tokens per row
      new_tokens=4 if arg == 'tiny' else 32,  # generated per prompt of length / 2 tokens
      steps=2 if arg == 'tiny' else 5,  # timed rounds; the median is kept
      seed=0,
      peak_flops=0.0,  # FLOP/s of one device for MFU; 0: a known accelerator's bf16 peak
      torch=True))  # time transformers' PyTorch eager beside it, on a CPU
  return config
