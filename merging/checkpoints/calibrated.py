"""Data-driven merges of decoder checkpoints, RegMean and RegMean++, streamed a layer at a time.

RegMean's W_m = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_t (merging/regmean.py) solves each linear layer from
its input Grams G_t = Σ xᵀx over text. Here the text is a calibration file cut into windows,
and the Grams are taken a layer at a time: each model's residual stream over the windows, one
(windows, length, hidden) array per model, is carried from one layer to the next, and only
the layer being merged is read, of every model. The memory is the models' copies of one layer
and their streams, not the models. The stages, in the order the output is written:

  embedding   the mean of the models' embeddings; each stream starts as model t's embedding of
              the tokens (RegMean), or the merged one's (RegMean++)
  layer l     every linear layer of block l solved from its Grams, taken through model t's own
              block on stream t; every other leaf (norms, biases) the mean; stream t then goes
              on through model t's block (RegMean) or through the merged one (RegMean++)
  head        the final norm the mean; an untied lm_head solved from the Grams of
              final_norm(stream t), under model t's norm (RegMean) or the merged one (RegMean++)

This is merging.regmean and merging.regmean_plusplus on the whole decoder, whose Grams are
taken on the same data through the same layers, in the same order (tests/test_calibrated_merges.py
holds the two equal). Grams count real tokens only: the padding of a document's last window
weighs 0. The output is θ0 + λ·(θ_m − θ0), θ0 the base.
"""

import functools
import hashlib
import threading
import time
from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

import merging
from editing import scoring
from editing import settings
from editing import tree as tree_lib
from editing.errors import UserError
from editing.models import decoder
from editing.models import hf
from editing.models import keymap
from editing.models.decoder_config import DecoderConfig
from editing.models.tokenizer import Tokenizer
from merging import regmean
from third_party import hf_decoder

# The methods that declare how their streams move (`merging.Method.streams`).
METHODS = tuple(name for name, method in merging.REGISTRY.items() if method.streams)

# config.calibration of a checkpoint merge (configs/merge_checkpoints.py).
SETTINGS = dict(
    file=settings.text('', 'the calibration text of regmean and regmean_plusplus (.txt, '
                           '.jsonl, .parquet); \'\': none'),
    field=settings.text('text', 'the field of a .jsonl line or the column of a .parquet file '
                                'that holds the text'),
    length=settings.integer(256, '[2, inf)', 'tokens a window holds'),
    windows=settings.integer(64, '[1, inf)', 'windows read at most, from the file\'s start'))


class Calibration(NamedTuple):
  """Token windows of the calibration text, each row one window."""

  tokens: np.ndarray  # (windows, length) int32
  mask: np.ndarray  # (windows, length) bool, False on padding


def read(values: dict, base: str) -> Calibration:
  """The windows of config.calibration's file (`SETTINGS`, checked), read by the tokenizer of
  the base checkpoint `base`."""
  documents = scoring.read_documents(values['file'], values['field'])
  return windows(Tokenizer.from_directory(base), documents, values['length'],
                 values['windows'], values['file'])


def windows(tokenizer: Tokenizer, documents: Sequence[str], length: int, count: int,
            source: str) -> Calibration:
  """The first `count` windows of `length` tokens of the documents: each document encoded
  without special tokens after one prefix token (BOS, or EOS where there is none), as the
  perplexity scorer reads it, and cut into consecutive windows that do not cross documents;
  a document's last window is padded."""
  prefix = tokenizer.prefix_id()
  rows = []
  for document in documents:
    stream = [prefix] + tokenizer.encode(document, add_special_tokens=False)
    rows += [stream[start:start + length] for start in range(0, len(stream) - 1, length)]
    if len(rows) >= count:
      break
  if not rows:
    raise UserError(f'{source}: its text encodes to no tokens to calibrate on')
  rows = rows[:count]
  tokens = np.zeros((len(rows), length), np.int32)
  mask = np.zeros((len(rows), length), bool)
  for i, row in enumerate(rows):
    tokens[i, :len(row)], mask[i, :len(row)] = row, True
  return Calibration(tokens, mask)


@functools.lru_cache(maxsize=None)
def _block_program(config: DecoderConfig, layer: int):
  """jit(params, x, mask) -> (block(x), {kernel path: Σ_real tokens xᵀx}) for block `layer`;
  the blocks that share a window and a RoPE share it."""
  block = decoder.Block(config, layer)

  def run(params, x, mask):
    positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
    grams = {}
    with nn.intercept_methods(regmean.capture_grams(mask.astype(jnp.float32), grams)):
      y, _ = block.apply({'params': params}, x, positions, jnp.where(mask, positions, -1))
    return y, grams

  return jax.jit(run)


def _representative(config: DecoderConfig, layer: int) -> int:
  """The first layer whose block computes as `layer`'s does (same window, same RoPE)."""
  return next(j for j in range(layer + 1)
              if config.window(j) == config.window(layer) and
              config.rope_of(j) == config.rope_of(layer))


def _stages(config: DecoderConfig, names) -> dict[str, int]:
  """{HF name: its stage}: 0 the embedding (and the tied head and buffers, which are not
  parameters), l + 1 block l, L + 1 the final norm and the head."""
  stages = {n: 0 for n in names}
  for ours, theirs, _ in hf_decoder.rules(config):
    first = ours.split('/')[0]
    if first.startswith('blocks_'):
      stages[theirs] = int(first[len('blocks_'):]) + 1
    elif first != 'embed':
      stages[theirs] = config.num_layers + 1
  return stages


def digest(data: Calibration) -> str:
  """The SHA-256 of the windows and their mask: a resume reads the same calibration."""
  return hashlib.sha256(data.tokens.tobytes() + data.mask.tobytes() +
                        str(data.tokens.shape).encode()).hexdigest()


class LayerMerge:
  """The merged tensors of decoder checkpoints, under their Hugging Face names, made a stage at
  a time as `tensor` asks for them in `order_of`'s order; thread-safe, as the shard writer's threads
  prepare tensors ahead."""

  def __init__(self, base: hf.Reader, models: Sequence[hf.Reader], method: str, values: dict,
               scale: float, data: Calibration, wanted: set[str] | None = None):
    """`wanted`: the tensors `tensor` will be asked for (default every one); the others'
    stages still run, for the streams, but their tensors are not kept."""
    if method not in METHODS:
      raise ValueError(f'{method} is not a calibrated merge')
    self.config = DecoderConfig.from_hf(base.config)
    self._base, self._models = base, list(models)
    self._plusplus = merging.get(method).streams == 'merged'
    self._alpha, self._batch = values['alpha'], values['batch_size']
    self._scale, self._data = scale, data
    self._wanted = set(base.files) if wanted is None else set(wanted)
    rules = hf_decoder.rules(self.config)
    self._stage = _stages(self.config, base.files)
    self._rules = {stage: [r for r in rules if self._stage[r[1]] == stage]
                   for stage in range(self.config.num_layers + 2)}
    self._lock, self._done, self._ready = threading.Lock(), -1, {}
    self._streams: list[jax.Array] = []

  @staticmethod
  def check(base: hf.Reader) -> DecoderConfig:
    """The base's decoder config; its tensors are every one the config has, and RoPE buffers
    or the tied head, else one error naming the tensors."""
    config = DecoderConfig.from_hf(base.config)
    hf_decoder.check_tensors({n: base.header(n)[0] for n in base.files}, config)
    return config

  @staticmethod
  def order_of(base: hf.Reader) -> list[str]:
    """The output's tensor names in the order they are made."""
    stages = _stages(DecoderConfig.from_hf(base.config), base.files)
    return sorted(stages, key=lambda name: (stages[name], name))

  def tensor(self, name: str) -> np.ndarray:
    """The merged tensor `name` (each is handed out once, and then forgotten)."""
    with self._lock:
      while self._done < self._stage[name]:
        self._done += 1
        start = time.time()
        self._ready.update(self._make(self._done))
        logging.info('calibrated merge: stage %d of %d (0 the embedding, then the layers, '
                     'then the head) in %.1f s', self._done, self.config.num_layers + 1,
                     time.time() - start)
      return self._ready.pop(name)

  def _make(self, stage: int) -> dict[str, np.ndarray]:
    """{HF name: merged tensor} of one stage, the streams moved past it."""
    rules = self._rules[stage]
    params = [{rule[0]: hf_decoder.leaf(rule, lambda n: ckpt.tensor(n).astype(np.float32),
                                        self.config) for rule in rules}
              for ckpt in self._models]
    if stage == 0:
      merged = self._embedding(params)
    elif stage <= self.config.num_layers:
      merged = self._block(stage - 1, params)
    else:
      merged = self._head(params)
    theirs = keymap.to_theirs(rules, merged)
    if stage == 0:  # what is not a parameter: the tied head, the merged embedding; a buffer
      for name in self._base.files:
        if self._stage[name] == 0 and name not in theirs:
          theirs[name] = (theirs[hf_decoder.EMBEDDING] if name == hf_decoder.TIED_HEAD
                          else self._base.tensor(name))
    theirs = {n: x for n, x in theirs.items() if n in self._wanted}
    if self._scale != 1:
      theirs = {n: self._scaled(n, x) for n, x in theirs.items()}
    return theirs

  def _scaled(self, name: str, merged: np.ndarray) -> np.ndarray:
    base = self._base.tensor(name).astype(np.float32)
    return base + self._scale * (merged.astype(np.float32) - base)

  def _embedding(self, params: list[dict]) -> dict[str, np.ndarray]:
    path = 'embed/embedding'
    mean = np.mean([p[path] for p in params], axis=0, dtype=np.float32)
    scale = self.config.hidden_size**0.5 if self.config.family.gemma else 1.0
    tables = [mean] * len(params) if self._plusplus else [p[path] for p in params]
    self._streams = [jnp.asarray(table[self._data.tokens] * np.float32(scale), jnp.float32)
                     for table in tables]
    return {path: mean}

  def _block(self, layer: int, params: list[dict]) -> dict[str, np.ndarray]:
    prefix = f'blocks_{layer}/'
    own = [tree_lib.unflatten({p[len(prefix):]: x for p, x in each.items()})
           for each in params]
    program = _block_program(self.config, _representative(self.config, layer))
    results = [self._over_batches(program, tree, stream) for tree, stream in
               zip(own, self._streams)]
    grams = [g for _, g in results]
    merged = self._solved(params, [{prefix + p: g for p, g in each.items()} for each in grams])
    if self._plusplus:
      tree = tree_lib.unflatten({p[len(prefix):]: x for p, x in merged.items()})
      self._streams = [self._over_batches(program, tree, s)[0] for s in self._streams]
    else:
      self._streams = [y for y, _ in results]
    return merged

  def _head(self, params: list[dict]) -> dict[str, np.ndarray]:
    norm_path, head_path = 'final_norm/scale', 'lm_head/kernel'
    mean_norm = np.mean([p[norm_path] for p in params], axis=0, dtype=np.float32)
    merged = {norm_path: mean_norm}
    if head_path in params[0]:
      c = self.config
      norm = decoder.RMSNorm(c.rms_norm_eps, c.family.gemma)
      weights = jnp.asarray(self._data.mask, jnp.float32)
      grams = []
      for p, stream in zip(params, self._streams):
        scale = mean_norm if self._plusplus else p[norm_path]
        x = norm.apply({'params': {'scale': scale}}, stream)
        grams.append({head_path: np.asarray(
            jnp.einsum('bn,bni,bnj->ij', weights, x, x), np.float64)})
      merged.update(self._solved(params, grams, paths=(head_path,)))
    return merged

  def _solved(self, params: list[dict], grams: list[dict],
              paths: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Each kernel with Grams solved by RegMean, every other leaf of `paths` the mean."""
    out = {}
    for path in paths or params[0]:
      if path in grams[0]:
        out[path] = np.asarray(regmean.solve([p[path] for p in params],
                                             [g[path] for g in grams], self._alpha))
      else:
        out[path] = np.mean([p[path] for p in params], axis=0, dtype=np.float32)
    return out

  def _over_batches(self, program, params: dict, stream: jax.Array):
    """(the block's outputs over the whole stream, its Grams summed in float64), in batches
    of the method's batch_size windows (the last padded with masked rows)."""
    count, size = stream.shape[0], self._batch
    outputs, totals = [], {}
    for start in range(0, count, size):
      x = stream[start:start + size]
      mask = self._data.mask[start:start + size]
      pad = size - x.shape[0]
      if pad:
        x = jnp.pad(x, ((0, pad), (0, 0), (0, 0)))
        mask = np.pad(mask, ((0, pad), (0, 0)))
      y, grams = program(params, x, jnp.asarray(mask))
      outputs.append(y[:size - pad])
      for path, gram in jax.device_get(grams).items():
        totals[path] = totals.get(path, 0.0) + gram.astype(np.float64)
    return jnp.concatenate(outputs), totals
