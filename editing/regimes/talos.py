"""TaLoS: fine-tune only the parameters least sensitive to the task, chosen by a sparse mask.

Iurada et al., "Efficient Model Editing with Task-Localized Sparse Fine-tuning", ICLR 2025.

Sensitivity of eligible entry j, on the task's calibration inputs x (its validation split), at θ0
with the frozen head, is the diagonal Fisher estimated with one sampled label per input:

  ŷ(x) ~ softmax(f(x; θ0)),    s_j = Σ_x (∂ f_ŷ(x)(x; θ0) / ∂θ_j)²,

the gradient of the sampled *raw logit* (not the log-softmax, not the loss), per example. Pruning
runs R rounds (default 4): round r rescores with fresh samples, gives entries already dropped a
score of +∞, and keeps the round(k^(r/R)·N) lowest-scoring of the N eligible entries under one
global threshold over every eligible leaf (ties broken by position, so the count is exact). The
last round keeps round(k·N), k = 0.1 by default. Fine-tuning then moves only the kept entries:
AdamW's step and decoupled weight decay are multiplied by the mask (`editing.train.mask_updates`)
while Adam's moments and the gradient clip see the unmasked gradients, and a leaf with no kept
entry is frozen outright.

Choices where the paper is silent:
- Eligible: the patch embedding, every attention and MLP weight and bias, every LayerNorm and the
  final projection (an ordinary linear layer). Not eligible, hence frozen: the class token and the
  position embeddings, input-independent offsets that shift every input's features, the opposite
  of a localized edit. (The authors' code leaves those and the projection dense by accident of
  its module structure.)
- Rounds after the first score the network whose dropped entries are scaled by `damping`
  (0.1, as the authors' code's layer masking does in rounds 2–4: a damped iterative selection);
  damping 1 scores θ0 itself in every round, so that rounds differ only in their sampled labels
  and the +∞ of dropped entries (this module's behaviour before the setting, under which
  docs/regimes.md's TaLoS rows were measured).
- Sample i of round r is drawn with fold_in(fold_in(key, r), i), so the scores do not depend on
  how the calibration set is split into batches.
- On a decoder (`DECODER_ELIGIBLE`): every attention and MLP weight and bias and every RMSNorm
  scale. Not the token embedding or an untied LM head: a row per vocabulary entry, and the rows
  of tokens calibration never reads score 0, so they would be kept and then only decay under
  AdamW's weight decay, an edit of the vocabulary rather than of the task's computation.
"""

import dataclasses

import jax
import numpy as np

from editing import gradients
from editing import settings as settings_lib
from editing import tree as tree_lib
from editing.regimes.base import LogitsFn, PyTree, Regime

ELIGIBLE = (
    r'patch_embed/kernel',
    r'blocks_\d+/attn/(query|key|value|out)/(kernel|bias)',
    r'blocks_\d+/(mlp_fc|mlp_proj)/(kernel|bias)',
    r'(blocks_\d+/ln_1|blocks_\d+/ln_2|ln_pre|ln_post)/(scale|bias)',
    r'proj/kernel',
)
# The decoder's names (editing.models.decoder); each pattern matches in every family, since
# `tree.select` refuses one that matches nothing.
DECODER_ELIGIBLE = (
    r'blocks_\d+/attn/(query|key|value|out)/(kernel|bias)',
    r'blocks_\d+/mlp/(gate|up|down)/(kernel|bias)',
    r'(blocks_\d+/(input_norm|post_attn_norm|pre_mlp_norm|post_mlp_norm|attn/query_norm|'
    r'attn/key_norm)|final_norm)/scale',
)


def sensitivity(logits_fn: LogitsFn, params: PyTree, paths: list[str], images: np.ndarray,
                key: jax.Array, batch_size: int = 32) -> dict[str, np.ndarray]:
  """s_j = Σ_i (∂ f_ŷᵢ(xᵢ) / ∂θ_j)² for the leaves at `paths`, ŷᵢ ~ softmax(f(xᵢ)).

  Per-example gradients come from `jax.vmap` over chunks of `batch_size` inputs; label i is
  drawn with fold_in(key, i).
  """
  return _scorer(logits_fn, params, paths, batch_size)(images, np.arange(len(images)), key)


def _scorer(logits_fn, params, paths, batch_size) -> gradients.SquaredGradientSum:
  def sampled_logit(params, image, index, key):
    logits = logits_fn(params, image[None])[0]
    label = jax.random.categorical(jax.random.fold_in(key, index),
                                   jax.lax.stop_gradient(logits))
    return logits[label]

  return gradients.SquaredGradientSum(sampled_logit, params, paths, batch_size)


def calibrate(logits_fn: LogitsFn, params: PyTree, paths: list[str], images: np.ndarray,
              key: jax.Array, *, keep: float, rounds: int, damping: float,
              batch_size: int = 32) -> dict[str, np.ndarray]:
  """The TaLoS mask {path: bool array}: True on the least sensitive entries, kept for training.

  After round r of `rounds`, exactly round(keep^(r/rounds) · N) of the N entries of the leaves
  at `paths` are True: the lowest scores of that round among those still kept, one threshold
  over all leaves, ties to the earlier (path-sorted, row-major) position. Round r scores the
  params with the entries dropped so far multiplied by `damping`.
  """
  flat = tree_lib.flatten(params)
  kept = {p: np.ones(np.shape(flat[p]), bool) for p in paths}
  total = sum(m.size for m in kept.values())
  scorer = _scorer(logits_fn, params, paths, batch_size)
  for r in range(1, rounds + 1):
    damped = tree_lib.unflatten({**flat, **{p: np.where(kept[p], flat[p], damping * flat[p])
                                            for p in paths}})
    scores = scorer(images, np.arange(len(images)), jax.random.fold_in(key, r), params=damped)
    # The lowest scores are the highest negated ones; entries already dropped score +∞.
    negated = {p: np.where(kept[p], -scores[p], -np.inf) for p in paths}
    count = int(round(keep ** (r / rounds) * total))
    kept = {p: np.asarray(m) for p, m in
            tree_lib.top_k(negated, lambda n, count=count: count, 'global').items()}
  return kept


@dataclasses.dataclass(frozen=True)
class Talos(Regime, settings_lib.Declared):
  """Sparse fine-tuning of the least task-sensitive fraction `keep` of the eligible entries;
  its settings (config.talos) are declared in `settings`."""

  settings = dict(
      keep=settings_lib.number(0.1, '(0, 1]', 'k, the fraction of eligible entries that train '
                                           '(0.1 = 90% sparsity)'),
      rounds=settings_lib.integer(4, '[1, inf)', 'R, the pruning rounds, each rescoring'),
      damping=settings_lib.number(0.1, '[0, 1]', 'the factor on dropped entries in the network '
                                             'rounds after the first score (1: θ0 each round)'),
      batch_size=settings_lib.integer(32, '[1, inf)', 'examples per vmapped chunk of per-example '
                                                  'gradients'))

  keep: float = settings['keep'].default
  rounds: int = settings['rounds'].default
  damping: float = settings['damping'].default
  batch_size: int = settings['batch_size'].default

  def update_mask(self, params, *, logits_fn, images, key):
    paths = [p for p, eligible in self.trainable(params).items() if eligible]
    return calibrate(logits_fn, params, paths, images, key, keep=self.keep, rounds=self.rounds,
                     damping=self.damping, batch_size=self.batch_size)


TALOS = Talos('talos', trainable_patterns=ELIGIBLE)
