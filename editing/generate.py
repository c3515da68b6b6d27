"""Text generation with the decoder: one jitted loop over a preallocated KV cache.

Prompts (lists of token ids) are left-padded into a (batch, prompt) block whose sizes are
rounded up to powers of two, so that one program serves every request of the same bucket
(batch, prompt length, new tokens, and the sizes of the stop lists): `prefill` writes the
prompts into the cache and gives the first token; a `lax.while_loop` then writes one token per
row per step, until every row has stopped or `max_new_tokens` are made.

Each next token is drawn by `sample_next`: greedy (argmax) at temperature 0; otherwise from
softmax(logits / T) restricted to the nucleus, the fewest most likely tokens whose mass
reaches top_p (Holtzman et al., "The Curious Case of Neural Text Degeneration", ICLR 2020),
with a key from `fold_in(key, step)`. A row stops after an EOS id or after a stop sequence;
the stop tokens are kept in its output, and what follows is `pad_id`.
"""

import dataclasses
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing.errors import UserError
from editing.models import decoder
from editing.models.decoder_config import DecoderConfig

_COMPILED: dict = {}  # bucket -> compiled generation program


class Generated(NamedTuple):
  """tokens (batch, max_new_tokens): the new tokens, pad_id after a row stopped; lengths
  (batch,): how many each row made, its stop tokens included; tokens_per_second: new tokens
  over the time the compiled program ran (compilation excluded)."""

  tokens: np.ndarray
  lengths: np.ndarray
  tokens_per_second: float


@dataclasses.dataclass(frozen=True)
class _Bucket:
  config: DecoderConfig
  batch: int
  prompt: int
  new_tokens: int
  eos: int
  stops: int
  stop_length: int


def bucket_size(n: int, smallest: int = 1) -> int:
  """The power of two ≥ max(n, smallest)."""
  return 1 << (max(n, smallest) - 1).bit_length()


def sample_next(logits, key, temperature, top_p):
  """A token per row of logits (rows, vocab): argmax where temperature is 0, else a draw
  from softmax(logits / temperature) over the nucleus of mass top_p."""
  greedy = jnp.argmax(logits, axis=-1)
  scaled = logits / jnp.maximum(temperature, 1e-6)
  ordered = jnp.sort(scaled, axis=-1)[..., ::-1]
  probs = jax.nn.softmax(ordered, axis=-1)
  # A token stays when the mass of the tokens more likely than it is below top_p: the first
  # always does.
  kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True)
  threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
  nucleus = jnp.where(scaled >= threshold, scaled, -jnp.inf)
  drawn = jax.random.categorical(key, nucleus, axis=-1)
  return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def _stopped(token, window, eos, stops, stop_active):
  """Whether each row's last token is an EOS id or its last tokens (`window`, right-aligned)
  end with an active stop sequence (right-aligned, −1 = any token)."""
  is_eos = jnp.any(token[:, None] == eos[None], axis=-1)
  agree = (stops[None] == -1) | (window[:, None, :] == stops[None])
  return is_eos | jnp.any(jnp.all(agree, axis=-1) & stop_active[None], axis=-1)


def _program(bucket: _Bucket, dtype):
  """The generation function of one bucket (to be jitted)."""
  model = decoder.Decoder(bucket.config, dtype)
  slots = bucket.prompt + bucket.new_tokens

  def run(params, prompts, mask, eos, stops, stop_active, key, temperature, top_p, pad_id):
    batch = prompts.shape[0]
    lengths = jnp.sum(mask, axis=1)
    cache = decoder.init_cache(bucket.config, batch, slots, dtype)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    logits, cache = model.apply({'params': params}, prompts, positions, mask, cache)
    first = sample_next(logits[:, -1], jax.random.fold_in(key, 0), temperature, top_p)

    def cond(state):
      step, _, _, done, *_ = state
      return (step < bucket.new_tokens) & ~jnp.all(done)

    def body(state):
      step, token, cache, done, out, made, window = state
      token = jnp.where(done, pad_id, token)
      out = out.at[:, step].set(token)
      made = made + (~done).astype(jnp.int32)
      window = jnp.concatenate([window[:, 1:], token[:, None]], axis=1)
      done = done | _stopped(token, window, eos, stops, stop_active)
      logits, cache = model.apply({'params': params}, token[:, None],
                                  (lengths + step)[:, None], jnp.ones((batch, 1), bool), cache)
      token = sample_next(logits[:, 0], jax.random.fold_in(key, step + 1), temperature, top_p)
      return step + 1, token, cache, done, out, made, window

    # Rows that only fill the batch bucket have no prompt, and are done from the start.
    state = (jnp.zeros((), jnp.int32), first, cache, ~jnp.any(mask, axis=1),
             jnp.full((batch, bucket.new_tokens), pad_id, jnp.int32),
             jnp.zeros(batch, jnp.int32), jnp.full((batch, bucket.stop_length), -1, jnp.int32))
    _, _, _, _, out, made, _ = jax.lax.while_loop(cond, body, state)
    return out, made

  return run


def _left_padded(prompts: Sequence[Sequence[int]], rows: int, length: int, pad_id: int):
  tokens = np.full((rows, length), pad_id, np.int32)
  mask = np.zeros((rows, length), bool)
  for i, prompt in enumerate(prompts):
    tokens[i, -len(prompt):], mask[i, -len(prompt):] = prompt, True
  return tokens, mask


def _stop_table(stop_sequences, rows: int, length: int):
  """(stops, active): each sequence right-aligned in a row of −1s; unused rows inactive."""
  stops = np.full((rows, length), -1, np.int32)
  active = np.zeros(rows, bool)
  for i, sequence in enumerate(stop_sequences):
    stops[i, length - len(sequence):], active[i] = sequence, True
  return stops, active


def _check(config, prompts, max_new_tokens, temperature, key, eos_ids, stop_sequences):
  ids = [('eos_ids', t) for t in eos_ids] + [('stop_sequences', t) for s in stop_sequences
                                             for t in s]
  for where, token in ids:
    if not isinstance(token, (int, np.integer)) or not 0 <= token < config.vocab_size:
      raise UserError(f'generate: {where} holds {token!r}, not a token id of the vocabulary '
                      f'(0 … {config.vocab_size - 1})')
  if not prompts or any(len(p) == 0 for p in prompts):
    raise UserError('generate: every prompt needs at least one token (a BOS token, say)')
  if max_new_tokens < 1:
    raise UserError(f'generate: max_new_tokens = {max_new_tokens} must be at least 1')
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > config.max_position_embeddings:
    raise UserError(f'generate: a prompt of {longest} tokens and {max_new_tokens} new ones '
                    f'exceed max_position_embeddings = {config.max_position_embeddings}')
  if temperature > 0 and key is None:
    raise UserError('generate: temperature > 0 samples, and sampling needs a key')
  if any(len(s) == 0 for s in stop_sequences):
    raise UserError('generate: a stop sequence is empty')


def generate(config: DecoderConfig, params, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             key: jax.Array | None = None, eos_ids: Sequence[int] = (),
             stop_sequences: Sequence[Sequence[int]] = (), pad_id: int = 0,
             dtype=jnp.float32) -> Generated:
  """Continues each prompt (a list of token ids) by up to `max_new_tokens` tokens: greedy at
  temperature 0, else nucleus sampling from `key`; a row stops at an id of `eos_ids` or at the
  end of one of `stop_sequences` (token lists)."""
  prompts = [list(p) for p in prompts]
  stop_sequences = [list(s) for s in stop_sequences]
  _check(config, prompts, max_new_tokens, temperature, key, list(eos_ids), stop_sequences)
  bucket = _Bucket(config, bucket_size(len(prompts)),
                   bucket_size(max(len(p) for p in prompts), 8), max_new_tokens,
                   bucket_size(len(eos_ids), 4), bucket_size(len(stop_sequences), 4),
                   bucket_size(max((len(s) for s in stop_sequences), default=1), 4))
  tokens, mask = _left_padded(prompts, bucket.batch, bucket.prompt, pad_id)
  eos = np.full(bucket.eos, -1, np.int32)
  eos[:len(eos_ids)] = eos_ids
  stops, active = _stop_table(stop_sequences, bucket.stops, bucket.stop_length)
  args = (params, tokens, mask, eos, stops, active,
          jax.random.PRNGKey(0) if key is None else key, np.float32(temperature),
          np.float32(top_p), np.int32(pad_id))
  signature = (bucket, jnp.dtype(dtype), str(jax.tree.map(lambda x: (x.shape, x.dtype), params)))
  if signature not in _COMPILED:
    _COMPILED[signature] = jax.jit(_program(bucket, dtype)).lower(*args).compile()
  start = time.perf_counter()
  out, made = jax.block_until_ready(_COMPILED[signature](*args))
  seconds = time.perf_counter() - start
  rows = len(prompts)
  made = np.asarray(made)[:rows]
  return Generated(np.asarray(out)[:rows], made, float(made.sum()) / max(seconds, 1e-9))
