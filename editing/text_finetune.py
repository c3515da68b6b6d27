"""Fine-tuning a decoder on (prompt, answer) token pairs, in any regime, through the one loop.

A pair is one row, prompt then answer, right-padded to a fixed length (`rows`), so that one
compiled step serves every batch. The loss is the causal-LM loss over answer tokens only,

  L(θ) = −(1/|A|) Σ_{(i,t) ∈ A} log softmax(f(x_i; θ)_{t−1})[x_{i,t}],

A the answer tokens of the batch, f(x; θ)_s the next-token logits at position s of the regime's
encoder: the decoder itself, or its linearization around θ0 (linearized, L-LoRA). Prompt
tokens and padding are read as context and never scored.

The regimes apply unchanged: the decoder's apply over a packed batch (tokens, positions, mask)
is their `apply_fn`, returning logits where an encoder returns features. For a decoder,
`regime(name)` gives LoRA the attention projections q, k, v, o as targets (PEFT's
target_modules q_proj, k_proj, v_proj, o_proj for Llama; `ATTENTION_MLP` adds gate_proj,
up_proj, down_proj) and TaLoS the decoder's eligible leaves (`talos.DECODER_ELIGIBLE`).

TaLoS scores each answer token as one calibration sample: its logits are those at the position
before it, ŷ ~ softmax of them, and s_j = Σ over the calibration pairs' answer tokens of
(∂ f_ŷ / ∂θ_j)², the encoders' per-example score with a token in place of an image.
"""

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from editing import regimes
from editing import sharding as sharding_lib
from editing import train as train_lib
from editing.errors import UserError
from editing.models import decoder
from editing.models.decoder_config import DecoderConfig
from editing.models.tokenizer import Tokenizer
from editing.regimes import attention_only
from editing.regimes import talos
from editing.regimes.base import Regime
from editing.task_vector import TaskVector

ATTENTION = attention_only.ATTENTION_WEIGHTS
ATTENTION_MLP = r'blocks_\d+/(attn/(query|key|value|out)|mlp/(gate|up|down))/kernel'
# The channels of a packed batch, (rows, channels, length) int32.
TOKENS, POSITIONS, MASK, READ = range(4)


def regime(name: str, settings: Mapping[str, Any] | None = None) -> Regime:
  """The regime `name` (editing.regimes) with `settings`, as it applies to a decoder: LoRA's
  targets default to q, k, v, o, and TaLoS's eligible leaves are the decoder's."""
  if name in (regimes.LORA.name, regimes.L_LORA.name):
    settings = {'targets': ATTENTION, **(settings or {})}
  chosen = regimes.get(name, settings)
  if isinstance(chosen, talos.Talos):
    chosen = dataclasses.replace(chosen, trainable_patterns=talos.DECODER_ELIGIBLE)
  return chosen


@dataclasses.dataclass(frozen=True)
class Rows:
  """(prompt, answer) rows, right-padded; a dataset of the training loop.

  Attributes:
    tokens: (n, length) int32, prompt then answer, then `pad_id`.
    positions: (n, length) int32, 0, 1, ... over the real tokens; 0 on padding.
    mask: (n, length) bool, True on real tokens.
    loss_mask: (n, length) float32, 1 on answer tokens, 0 on prompt tokens and padding.
    metric: what the evaluator scores them by (`score`): 'exact_match', the share of rows
      whose every answer token is the argmax; or 'likelihood', exp(mean log p) of the answer
      tokens (1 / perplexity), for held-out text.
  """

  tokens: np.ndarray
  positions: np.ndarray
  mask: np.ndarray
  loss_mask: np.ndarray
  metric: str = 'exact_match'

  def __len__(self) -> int:
    return len(self.tokens)

  def packed(self, indices=slice(None)) -> np.ndarray:
    """(rows, 3, length) int32 of the rows at `indices` (default all): tokens, positions and
    mask, the decoder's inputs as one array."""
    return np.stack([self.tokens[indices], self.positions[indices],
                     self.mask[indices].astype(np.int32)], axis=1)

  def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed inputs, loss mask) of the rows at `indices`, as the training loop reads them."""
    return self.packed(indices), self.loss_mask[indices]

  @property
  def labels(self) -> np.ndarray:
    """(n, length) int32: at each position, the answer token its logits predict, −1 where
    nothing is scored. A row is answered exactly when the argmax matches every label: greedy
    decoding then writes the answer and stops at its EOS, so exact match needs no sampling
    loop."""
    following = np.where(self.loss_mask[:, 1:] > 0, self.tokens[:, 1:], -1)
    return np.pad(following, ((0, 0), (0, 1)), constant_values=-1).astype(np.int32)

  def take(self, n: int) -> 'Rows':
    """The first n rows (all of them if there are fewer)."""
    return dataclasses.replace(self, tokens=self.tokens[:n], positions=self.positions[:n],
                               mask=self.mask[:n], loss_mask=self.loss_mask[:n])

  def loaded(self) -> 'Rows':
    """The rows in memory: they always are."""
    return self

  def predictions(self, features: np.ndarray) -> np.ndarray:
    """What the evaluator's features (`predicted_tokens`: (n, length, 2), the argmax and the
    log p of the next token) predict: the argmax at each answer position, −1 elsewhere, so
    that weight disentanglement counts a row as changed only where its answer is; for
    'likelihood', the log p."""
    if self.metric == 'likelihood':
      return features[..., 1]
    return np.where(self.labels >= 0, features[..., 0], -1).astype(np.int32)

  def correct(self, predictions: np.ndarray) -> np.ndarray:
    """Per row, whether every answer token is the argmax (`predictions`' tokens)."""
    labels = self.labels
    return ((predictions == labels) | (labels < 0)).all(axis=1)

  def score(self, predictions: np.ndarray) -> float:
    """Exact match, or the likelihood exp(mean log p) over the answer tokens."""
    if self.metric == 'likelihood':
      return float(np.exp(predictions[self.labels >= 0].astype(np.float64).mean()))
    return float(np.mean(self.correct(predictions)))


@dataclasses.dataclass(frozen=True)
class TextTask:
  """A text task's splits as rows, as a job reads them (`suite.Task` is an image task's)."""

  name: str
  train: Rows
  val: Rows
  test: Rows


def rows(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], *,
         length: int | None = None, pad_id: int = 0) -> Rows:
  """Each prompt followed by its answer, right-padded with `pad_id` to `length` tokens (default:
  the longest row's)."""
  if len(prompts) != len(answers) or not prompts:
    raise UserError(f'{len(prompts)} prompts for {len(answers)} answers: give one answer per '
                    'prompt, and at least one pair')
  for what, seqs in (('prompt', prompts), ('answer', answers)):
    empty = [i for i, s in enumerate(seqs) if len(s) == 0]
    if empty:
      raise UserError(f'{what} {empty[0]} is empty: an answer token is scored after at least '
                      'one prompt token, and an answer has at least one')
  sizes = [len(p) + len(a) for p, a in zip(prompts, answers)]
  length = max(sizes) if length is None else length
  if max(sizes) > length:
    longest = int(np.argmax(sizes))
    raise UserError(f'pair {longest} has {sizes[longest]} tokens, more than length = {length}')
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  loss_mask = np.zeros((len(prompts), length), np.float32)
  for i, (prompt, answer) in enumerate(zip(prompts, answers)):
    tokens[i, :sizes[i]] = list(prompt) + list(answer)
    loss_mask[i, len(prompt):sizes[i]] = 1
  mask = np.arange(length) < np.array(sizes)[:, None]
  positions = np.where(mask, np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return Rows(tokens, positions, mask, loss_mask)


def pairs(tokenizer: Tokenizer, examples: Sequence[tuple[str, str]], length: int) -> Rows:
  """(prompt, answer) strings as rows: BOS (`Tokenizer.prefix_id`, whether or not the
  tokenizer adds it) and the prompt's tokens, then the answer's and EOS, which is scored too:
  an answer is exact only if it ends."""
  eos = tokenizer.token_id('eos_token')
  if eos is None:
    raise UserError(f'the tokenizer of {tokenizer.source} has no EOS token to end an answer')
  prefix = tokenizer.prefix_id()
  return rows([[prefix] + tokenizer.encode(prompt, add_special_tokens=False)
               for prompt, _ in examples],
              [tokenizer.encode(answer, add_special_tokens=False) + [eos]
               for _, answer in examples], length=length, pad_id=_pad_id(tokenizer))


def documents(tokenizer: Tokenizer, texts: Sequence[str], length: int,
              metric: str = 'exact_match') -> Rows:
  """Texts as rows for language modelling: every token after the first (BOS) is scored,
  EOS included; `metric` as `Rows` takes it."""
  return dataclasses.replace(pairs(tokenizer, [('', text) for text in texts], length),
                             metric=metric)


def _pad_id(tokenizer: Tokenizer) -> int:
  pad = tokenizer.token_id('pad_token')
  return tokenizer.token_id('eos_token') if pad is None else pad


def predicted_tokens(encoder):
  """encoder(θ0, params, inputs) -> (rows, length, 2) float32: at each position the argmax
  token and the log p of the token that follows in the row, what the evaluator brings to the
  host instead of a vocabulary's logits per token (ids below 2^24 are exact in float32)."""

  def features(theta0, params, inputs):
    log_p = jax.nn.log_softmax(encoder(theta0, params, inputs).astype(jnp.float32), axis=-1)
    following = jnp.pad(inputs[:, TOKENS, 1:], ((0, 0), (0, 1)))
    chosen = jnp.take_along_axis(log_p, following[..., None], axis=-1)[..., 0]
    return jnp.stack([jnp.argmax(log_p, axis=-1).astype(jnp.float32), chosen], axis=-1)

  return features


def apply_fn(config: DecoderConfig, dtype=jnp.float32, remat: bool = False):
  """apply_fn(params, inputs) -> next-token logits (rows, length, vocab), float32, from packed
  inputs (rows, channels, length): the regimes' `apply_fn` for a decoder."""
  model = decoder.Decoder(config, dtype, remat)

  def apply(params, inputs):
    logits, _ = model.apply({'params': params}, inputs[:, TOKENS], inputs[:, POSITIONS],
                            inputs[:, MASK].astype(bool))
    return logits

  return apply


def answer_loss(logits: jax.Array, tokens: jax.Array,
                loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(L, the share of answer tokens that are the argmax), L = −mean over the answer tokens t of
  log softmax(logits_{t−1})[token_t]."""
  log_p = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  following = tokens[:, 1:, None]
  chosen = jnp.take_along_axis(log_p, following, axis=-1)[..., 0]
  hit = jnp.argmax(log_p, axis=-1) == following[..., 0]
  weight = loss_mask[:, 1:].astype(jnp.float32)
  count = jnp.maximum(weight.sum(), 1.0)
  return -(chosen * weight).sum() / count, (hit * weight).sum() / count


def loss_fn(encoder) -> train_lib.LossFn:
  """The loss of `editing.train.train` for a regime's training encoder, reading θ0 from
  consts = {'theta0': ...}: `answer_loss`, and the answer tokens' accuracy as a metric. (With
  `accumulation`, the loop averages its microbatches' means.)"""

  def loss(params, consts, inputs, loss_mask, rng):
    del rng
    logits = encoder(consts['theta0'], params, inputs)
    value, accuracy = answer_loss(logits, inputs[:, TOKENS], loss_mask)
    return value, {'accuracy': accuracy}

  return loss


def answer_token_inputs(data: Rows) -> np.ndarray:
  """(answer tokens, 4, length): per answer token of `data`, its row packed, and a READ channel
  that is 1 at the position whose logits predict that token, 0 elsewhere."""
  row, position = np.nonzero(data.loss_mask)
  read = np.zeros((len(row), 1, data.tokens.shape[1]), np.int32)
  read[np.arange(len(row)), 0, position - 1] = 1
  return np.concatenate([data.packed(row), read], axis=1)


def read_logits(logits: jax.Array, inputs: jax.Array) -> jax.Array:
  """(samples, vocab): each sample's logits at the position its READ channel marks."""
  return jnp.einsum('bl,blv->bv', inputs[:, READ].astype(logits.dtype), logits)


def update_mask(chosen: Regime, apply, theta0, calibration: Rows,
                key: jax.Array) -> dict[str, np.ndarray] | None:
  """The regime's update mask fitted on the answer tokens of `calibration` (TaLoS), or None
  for a dense regime; `apply` is the decoder's `apply_fn`."""
  encoder = chosen.encoder(apply)
  return chosen.update_mask(
      theta0, logits_fn=lambda params, inputs: read_logits(encoder(theta0, params, inputs),
                                                           inputs),
      images=answer_token_inputs(calibration), key=key)


def finetune(settings: ml_collections.ConfigDict, *, config: DecoderConfig, theta0,
             chosen: Regime, data: Rows, task: str, workdir: str,
             calibration: Rows | None = None, mesh: jax.sharding.Mesh | None = None,
             sharding_rules=sharding_lib.REPLICATED_RULES, dtype=jnp.float32,
             remat: bool = False) -> TaskVector:
  """Fine-tunes the decoder θ0 on `data` in the regime `chosen`; returns its task vector.

  Args:
    settings: the training section `editing.train.train` reads (steps, batch_size, ...; its
      seed also draws LoRA's A and TaLoS's samples).
    config: the decoder's config; theta0: its params.
    chosen: the regime, as `regime` makes it for a decoder.
    data: the training pairs, as `rows` makes them.
    task: the task's name, recorded in the vector.
    workdir: the run's checkpoints and metrics; a rerun resumes there.
    calibration: the pairs a regime with an update mask (TaLoS) is fitted on; default `data`.
    mesh: default, every device on the data axis.
    sharding_rules: (regex, partition spec) pairs placing the params.
    dtype: the compute dtype; remat: recompute each layer in the backward pass.
  """
  _check_fits(config, data, 'data')
  if calibration is not None:
    _check_fits(config, calibration, 'calibration')
  key = jax.random.PRNGKey(settings.seed)
  mask = update_mask(chosen, apply_fn(config, dtype), theta0,
                     data if calibration is None else calibration, key)
  initial = chosen.initial(theta0, key)
  trained = train_lib.train(
      settings, loss_fn=loss_fn(chosen.training_encoder(apply_fn(config, dtype, remat))),
      params=initial, trainable=chosen.trainable(initial), consts={'theta0': theta0},
      data=data, workdir=workdir, mesh=mesh or sharding_lib.make_mesh(),
      sharding_rules=sharding_rules, update_mask=mask)
  return chosen.task_vector(theta0, trained, task=task)


def _check_fits(config: DecoderConfig, data: Rows, name: str) -> None:
  """Token ids within the vocabulary and rows within the model's positions."""
  if data.tokens.max() >= config.vocab_size or data.tokens.min() < 0:
    raise UserError(f'{name}: token ids span [{data.tokens.min()}, {data.tokens.max()}], '
                    f'outside the vocabulary [0, {config.vocab_size})')
  if data.tokens.shape[1] > config.max_position_embeddings:
    raise UserError(f'{name}: rows of {data.tokens.shape[1]} tokens exceed '
                    f'max_position_embeddings = {config.max_position_embeddings}')
