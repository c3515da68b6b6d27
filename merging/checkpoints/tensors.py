"""How each tensor of a streamed merge is merged: through the same `merging` function the suite
calls, a block at a time by one jitted program, or whole (a method that reads a tensor whole;
one that ranks what its draws left), with what the method declares it keeps of each vector
(`merging.sparsity`) found beforehand: the cuts of its ranked masks, its draws' keys and
norms, the selection its scores make (`scored`)."""

import concurrent.futures
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import cuts
from editing import sharding
from editing import tree as tree_lib
from editing.errors import UserError
from editing.models import hf
from editing.task_vector import TaskVector
from merging import ops
from merging.checkpoints import layered
from merging.checkpoints import pipeline
from merging.checkpoints import plan as plan_lib
from merging.checkpoints import ranking
from merging.checkpoints import scored

_LEAF = 'tensor'  # the name of the one leaf a block's jitted merge sees


class TensorMerge:
  """How each tensor is merged: `prepare` checks a tensor's inputs and does what needs the
  whole tensor (the cuts of its ranked masks, its draws' norms, or the whole merge), and
  `block` merges a block of it with one call of the jitted `_edit_block`; `pool` runs each
  model's ranking in a thread."""

  def __init__(self, base: hf.Reader, tuned: Sequence[hf.Reader],
               paths: Sequence[str], plan: plan_lib.Plan, pool: concurrent.futures.Executor,
               positions: dict[str, float] | None = None):
    self.base, self.tuned, self.plan, self.pool = base, list(tuned), plan, pool
    self.paths = [base.path] + list(paths)
    self.labels = tuple(f'model_{i}' for i in range(len(tuned)))
    self.key = jax.random.PRNGKey(plan.seed)
    self.mesh = sharding.make_mesh()
    self.ranking = ranking.TensorRanking(base, tuned, plan, pool, self.key, self.labels)
    # Each tensor's t for the values that vary by layer: over the output's layers, or as
    # the caller plans them (over each slice's, `sliced.positions`).
    self.positions = positions or (layered.positions(list(base.files)) if plan.layered else {})
    self.phases = pipeline.Phases()
    self.finite = set()  # the blocks (name, first entry) whose inputs were checked finite
    # Where the blocks go to an accelerator (or over several devices), they are put there
    # first, so that the transfer is timed apart from the merge; one CPU device reads the
    # aligned buffers in place.
    self.transfers = self.mesh.size > 1 or jax.devices()[0].platform != 'cpu'

  def prepare(self, name: str) -> dict:
    """What `block` needs of the tensor `name` (whose inputs' shapes and dtypes the job
    checked before it wrote anything)."""
    with self.phases.timed('prepare'):
      return self._prepare(name)

  def _prepare(self, name: str) -> dict:
    shape, dtype = self.base.header(name)
    size = math.prod(shape)
    plan = self.plan.at(name, self.positions.get(name, 0.0))
    state = {'name': name, 'dtype': dtype, 'plan': plan}
    if not jnp.issubdtype(dtype, jnp.floating):
      state['copy'] = True  # integer buffers (position ids, masks) are not weights
    elif self.plan.whole_tensor:  # decided for the whole model, whatever varies by layer
      state['merged'] = self._merge_whole(name, shape, plan)
    elif self.plan.entry.scores is not None:
      state.update(self._scored(name, shape, dtype, plan))
    elif self.plan.sums is not None:
      state['totals'], _ = self._totals(name, size, dtype)
      if self.plan.entry.check_sums is not None:
        self.plan.entry.check_sums(state['totals'], name, plan.weights)
    elif plan.ranked:
      state['cuts'] = self.ranking.cuts(name, size, plan)
    elif plan.draws:
      row = ops.row_length(name, shape) if plan.rows else None
      if plan.rows and (row is None or row > pipeline.BLOCK):
        state['merged'] = self._merge_whole(name, shape, plan)  # rows no block can hold
      else:
        state['row'] = row
        keys, factors, drawn = self._draws(name, size, dtype, plan, row)
        state['draws'], state['drawn'] = (keys, factors), drawn
    return state

  @staticmethod
  def spans(state: dict, size: int) -> list[tuple[int, int]]:
    """The blocks a tensor is merged in: each of whole rows where its draws read rows."""
    return scored.row_blocks(size, state.get('row'))

  def _draws(self, name: str, size: int, dtype: np.dtype, plan: plan_lib.Plan,
             row: int | None) -> tuple:
    """What a merge in blocks draws from for the tensor `name`: each model's key of it
    (`ops.vector_key`, `ops.leaf_key`, as `ops.drop_and_rescale` keys a vector's leaf) and,
    where a draw's rescale reads norms, each model's ‖τ‖₁/‖m ⊙ τ‖₁ over the whole tensor,
    summed by a pass over its blocks (of whole rows of `row`, where draws read rows) first;
    then also the masks m that pass drew, by each block's first entry, a bit an entry
    (np.packbits), which the merge of the block reads instead of drawing them again."""
    keys = jnp.stack([ops.leaf_key(ops.vector_key(self.key, (label,)), name)
                      for label in self.labels])
    draws = [plan.sparsity(i).draw for i in range(len(self.tuned))]
    if not any(draw is not None and draw.norms and draw.p != 0 for draw in draws):
      return keys, None, None
    # Each block's sums, made by one program on one device, added on the host in float64:
    # the same bits on any device count.
    norms = np.zeros((len(self.tuned), 2))
    drawn = {}
    for start, stop in scored.row_blocks(size, row):
      buffers = pipeline.read_block([self.base] + self.tuned, name, start, stop, pipeline.BLOCK,
                                    dtype)
      magnitudes = [np.abs(pipeline.host_delta(theta, buffers[0])) for theta in buffers[1:]]
      packed, sums = _drawn_norms(plan, keys, np.uint32(start), magnitudes,
                                  _spread(plan, magnitudes, row))
      norms += np.asarray(sums, np.float64)
      drawn[start] = np.asarray(packed)
    return keys, ops.l1_factor(*jnp.asarray(norms.T, jnp.float32)), drawn

  def _read_checked(self, name: str, start: int, stop: int, dtype: np.dtype) -> list:
    """`pipeline.read_block` of every input, refused where it holds a NaN or an infinity (in a
    pass before the first block merges, one would make every block's sums NaN), in the first
    pass that reads the block; the merge's, the last, forgets it."""
    buffers = pipeline.read_block([self.base] + self.tuned, name, start, stop, pipeline.BLOCK,
                                  dtype)
    if not self.plan.allow_nonfinite and (name, start) not in self.finite:
      _check_finite(self.plan, name, self.paths, [np.isfinite(x).all() for x in buffers])
      self.finite.add((name, start))
    return buffers

  def _scored(self, name: str, shape: tuple[int, ...], dtype: np.dtype,
              plan: plan_lib.Plan) -> dict:
    """What the blocks of a method that scores entries (`merging.Method.scores`) read: the cut
    of the tensor's scores it keeps (`selection`; `scores`, which score a block again), in
    blocks of whole rows where they are scored by rows (`row`), and each block's mask of it
    where made beforehand (`masks`); with sums, those over what it keeps and the entry count.
    A tensor whose rows no block holds is merged whole."""
    size, found = math.prod(shape), {}
    if plan.scores is not None:
      row = ops.row_length(name, shape) if plan.scores.rows else None
      if plan.scores.rows and (row is None or row > pipeline.BLOCK):
        return {'merged': self._merge_whole(name, shape, plan)}
      found['row'] = row
      found['scores'] = scored.TensorScores(
          plan.scores, lambda start, stop: self._read_checked(name, start, stop, dtype), size,
          row)
      found['selection'], found['masks'] = found['scores'].selection()
    if self.plan.sums is not None:
      found['entries'] = np.float32(size)
      found['totals'], found['masks'] = self._totals(name, size, dtype, found.get('scores'),
                                                     found.get('selection'),
                                                     found.get('masks'))
    return found

  def _totals(self, name: str, size: int, dtype: np.dtype,
              scores: scored.TensorScores | None = None, selection: cuts.Cut | None = None,
              masks: dict | None = None) -> tuple:
    """The method's sums over the tensor `name` (`merging.Method.sums`; of the entries its
    `selection` of the `scores` keeps, where it selects), by a pass over its blocks, each
    block's added on the host in float64 (the same bits on any device count); and the masks of
    the selection, by each block's first entry, packed: `masks` where given, else made by this
    pass, which the merge of each block reads instead of scoring it again (None where nothing
    is selected)."""
    total = 0.0
    if selection is not None and masks is None:
      masks = {}
    for start, stop in scores.spans if scores is not None else pipeline.blocks(size):
      buffers = self._read_checked(name, start, stop, dtype)
      selected = None
      if selection is not None:
        if start not in masks:
          masks[start] = np.packbits(scores.mask(start, stop, buffers, selection))
        selected = scored.unpacked(masks[start])
      total = total + np.asarray(_block_sums(self.plan, buffers[0], buffers[1:], selected),
                                 np.float64)
    return np.asarray(total, np.float32), masks

  def _merge_whole(self, name: str, shape: tuple[int, ...], plan: plan_lib.Plan) -> np.ndarray:
    """A tensor merged whole, op by op under its own name (an SVD merge; a ranking of what
    draws left), flat, as written."""
    base = self.base.tensor(name)
    thetas = [c.tensor(name) for c in self.tuned]
    _check_finite(self.plan, name, self.paths,
                  [tree_lib.first_nonfinite({name: x}) is None for x in [base] + thetas])
    # A method that reads the tensor as a whole (an SVD, a cosine) runs on one device: split,
    # its reductions would be collectives across the devices for one tensor's sake.
    placed = _split(self.mesh, shape) if plan.elementwise else jax.devices()[0]
    theta0 = {name: jax.device_put(base, placed)}
    vectors = task_vectors(theta0, [{name: jax.device_put(t, placed)} for t in thetas],
                            self.labels)
    keep = None
    if self.ranking.rankings is not None:
      keep = []
      for model_ranking, vector in zip(self.ranking.rankings, vectors):
        ranked = np.abs(model_ranking.ranked(name, vector.delta[name])).ravel()
        keep.append({name: ranking.kept_mask(ranked, model_ranking.cuts(name, ranked))
                     .reshape(shape)})
    edited = edit(plan, theta0, vectors, self.key, keep)[name]
    return self._checked(name, np.asarray(edited).astype(plan.output_dtype(base.dtype),
                                                          copy=False).ravel())

  def block(self, state: dict, start: int, stop: int) -> np.ndarray:
    name = state['name']
    if 'copy' in state:
      return self.base.read(name, start, stop)
    if 'merged' in state:
      return state['merged'][start:stop]
    with self.phases.timed('read'):
      buffers = self._read_checked(name, start, stop, state['dtype'])
    self.finite.discard((name, start))
    block_cuts = draws = selected = None
    if state.get('masks'):  # each block is merged once: its mask is not held past it
      selected = scored.unpacked(state['masks'].pop(start))
    elif 'selection' in state:
      selected = state['scores'].mask(start, stop, buffers, state['selection'])
    if 'draws' in state:
      # Each block is merged once: its masks drawn beforehand are not held past it.
      drawn = state['drawn'].pop(start) if state['drawn'] else None
      spread = None
      if state.get('row') and (drawn is None or not _l1_only(state['plan'], len(self.tuned))):
        spread = _spread(state['plan'], [np.abs(pipeline.host_delta(theta, buffers[0]))
                                         for theta in buffers[1:]], state['row'])
      draws = (*state['draws'], np.uint32(start), spread, drawn)
    if 'cuts' in state:
      block_cuts = [tuple(cuts.Cut(np.float32(c.threshold),
                                   np.int32(min(max(c.last - start, -1), pipeline.BLOCK)))
                          for c in model_cuts) for model_cuts in state['cuts']]
    # On one CPU device the program reads the aligned buffers in place; np.asarray waits for
    # it, after which this thread may read into them again.
    inputs = buffers
    if self.transfers:
      with self.phases.timed('to_device'):
        inputs = jax.block_until_ready(jax.device_put(
            buffers, _split(self.mesh, (pipeline.BLOCK,)) if self.mesh.size > 1
            else jax.devices()[0]))
    with self.phases.timed('compute'):
      edited = jax.block_until_ready(_edit_block(state['plan'], inputs[0], inputs[1:],
                                                 block_cuts, draws, state.get('totals'),
                                                 selected, state.get('entries')))
    with self.phases.timed('from_device'):
      edited = np.asarray(edited)
    if any(np.may_share_memory(edited, b) for b in buffers):
      edited = edited.copy()  # an output XLA forwarded from a buffer that will be read into
    # Cast here, from the dtype as stored: JAX without x64 sees float64 as float32. An
    # overflow is reported by `_checked`, not warned of.
    with np.errstate(over='ignore'):
      edited = edited[:stop - start].astype(self.plan.output_dtype(state['dtype']), copy=False)
    return self._checked(name, edited)

  def _checked(self, name: str, merged: np.ndarray) -> np.ndarray:
    """`merged`, refused if it holds a NaN or an infinity that finite inputs turned into (a
    scale that overflows the output's dtype), unless the plan allows them."""
    if not self.plan.allow_nonfinite and not np.isfinite(merged).all():
      raise UserError(f'the merged {name} holds non-finite values (NaN or infinity) in '
                      f'{merged.dtype}; lower config.scale, write another config.dtype, or set '
                      'config.allow_nonfinite to write it anyway')
    return merged


def _check_finite(plan: plan_lib.Plan, name: str, paths: Sequence[str],
                  finite: Sequence[bool]) -> None:
  """An error naming the first input whose tensor `name` holds a NaN or an infinity, unless the
  plan allows them."""
  for path, ok in zip(paths, finite):
    if not ok and not plan.allow_nonfinite:
      raise UserError(f'{path}: {name} holds non-finite values (NaN or infinity); set '
                      'config.allow_nonfinite to merge it anyway')


@functools.partial(jax.jit, static_argnums=0)
def _edit_block(plan: plan_lib.Plan, base: jax.Array, thetas: list,
                block_cuts: list | None, draws: tuple | None, totals: jax.Array | None,
                selected: jax.Array | None, entries: jax.Array | None) -> jax.Array:
  """One block's edit as one XLA program, compiled once per dtype (the block
  is the one leaf `_LEAF`, whatever its tensor): what `edit` makes of it, with the masks of
  the method's cuts (each cut relative to the block) and its vectors after their draws from
  the tensor's `draws` (each model's key, its L1 factors or None, the block's first entry,
  each model's keep probabilities where they spread over its rows, or None, and the block's
  masks where a pass drew them before, packed a bit an entry, or None), the sums over the
  whole tensor that the method reads (`merging.Method.sums`), and the block's mask of what a
  method that scores the entries keeps with the tensor's entry count
  (`merging.Method.scores`)."""
  vectors = task_vectors({_LEAF: base}, [{_LEAF: t} for t in thetas],
                          [f'model_{i}' for i in range(len(thetas))])
  keep = dropped = None
  if block_cuts is not None:
    keep = [{_LEAF: ranking.kept_mask(jnp.abs(vector.delta[_LEAF]), model_cuts)}
            for vector, model_cuts in zip(vectors, block_cuts)]
  if draws is not None:
    keys, factors, start, spread, drawn = draws
    dropped = []
    for i, vector in enumerate(vectors):
      draw, delta = plan.sparsity(i).draw, vector.delta[_LEAF]
      if draw is not None and draw.p != 0:  # as `ops.drop_and_rescale`, which leaves τ as it is
        q = _keep_probability(draw, spread, i)
        kept = (ops.kept_entries(keys[i], q, start, delta.size) if drawn is None
                else jnp.unpackbits(drawn[i], count=delta.size).astype(bool))
        delta = ops.dropped(delta, kept, q, draw.rescale, None if factors is None else factors[i])
      dropped.append({_LEAF: delta})
  leaf = lambda value: None if value is None else {_LEAF: value}
  return edit(plan, {_LEAF: base}, vectors, None, keep, dropped, leaf(totals), leaf(selected),
              leaf(entries))[_LEAF]


@functools.partial(jax.jit, static_argnums=0)
def _block_sums(plan: plan_lib.Plan, base: jax.Array, thetas: list,
                selected: jax.Array | None) -> jax.Array:
  """The method's sums over one block (`merging.Method.sums`; zero padding adds nothing), of
  the entries `selected` where given."""
  theta0 = jnp.asarray(base, jnp.float32)
  deltas = [jnp.asarray(t, jnp.float32) - theta0 for t in thetas]
  if selected is not None:
    deltas = [jnp.where(selected, d, 0.0) for d in deltas]
  return plan.sums(theta0, deltas)


def _spread(plan: plan_lib.Plan, magnitudes: list[np.ndarray], row: int | None) -> list | None:
  """Each model's keep probabilities of a block of whole rows of `row` (then padding, kept)
  whose |τ| are `magnitudes`, where its draw spreads them over the row's ranks (else None);
  None where no draw does. Ranked on the host (`ops.host_rank_spread`)."""
  if not row:
    return None
  spread = []
  for i, block in enumerate(magnitudes):
    draw = plan.sparsity(i).draw
    if draw is None or not draw.rows:
      spread.append(None)
      continue
    whole = block.size - block.size % row
    q = np.ones(block.size, np.float32)
    q[:whole] = ops.host_rank_spread(block[:whole].reshape(-1, row), 1 - draw.p,
                                     draw.spread).ravel()
    spread.append(q)
  return spread


def _l1_only(plan: plan_lib.Plan, models: int) -> bool:
  """Whether every model's draw rescales to its L1 norms: with its masks drawn beforehand, its
  keep probabilities are then read by nothing, so no row need be ranked again for them."""
  return all(draw is None or draw.p == 0 or draw.norms
             for draw in (plan.sparsity(i).draw for i in range(models)))


def _keep_probability(draw, spread: list | None, model: int):
  """Model `model`'s keep probability in a block: its own per entry where its draw spreads it
  over rows (`_spread`), else 1 − p (a constant in the program, as in the in-memory merge)."""
  return 1 - draw.p if spread is None or spread[model] is None else spread[model]


@functools.partial(jax.jit, static_argnums=0)
def _drawn_norms(plan: plan_lib.Plan, keys: jax.Array, start: jax.Array, magnitudes: list,
                 spread: list | None) -> tuple[jax.Array, jax.Array]:
  """Each model's keep mask of its draw of a block of a tensor from entry `start` on (all kept
  where it draws nothing; its keep probabilities where they spread over rows, `_spread`),
  packed a bit an entry, and each model's (‖τ‖₁, ‖m ⊙ τ‖₁) over the block, given |τ|
  (`magnitudes`)."""
  masks, sums = [], []
  for i, (key, magnitude) in enumerate(zip(keys, magnitudes)):
    draw = plan.sparsity(i).draw
    if draw is None or draw.p == 0:
      mask = jnp.ones(magnitude.size, bool)
    else:
      mask = ops.kept_entries(key, _keep_probability(draw, spread, i), start, magnitude.size)
    masks.append(jnp.packbits(mask))
    sums.append(jnp.stack([jnp.sum(magnitude), jnp.sum(jnp.where(mask, magnitude, 0.0))]))
  return jnp.stack(masks), jnp.stack(sums)


def _split(mesh: jax.sharding.Mesh, shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
  """An array's placement: its first dimension that the device count divides is split over all
  devices (every method is elementwise or ranks on the host, so the bits do not change), or
  it is replicated."""
  for d, size in enumerate(shape):
    if size % mesh.size == 0:
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
          *[None] * d, sharding.MESH_AXES))
  return sharding.replicated(mesh)


def task_vectors(theta0: dict, tuned: Sequence[dict], labels: Sequence[str]) -> list:
  """τ_t = θ_t − θ0 in float32, one vector per fine-tuned model, over θ0's names."""
  return [TaskVector({n: jnp.asarray(theta[n], jnp.float32) - jnp.asarray(x, jnp.float32)
                      for n, x in theta0.items()}, (label,), 'full', 'streamed')
          for theta, label in zip(tuned, labels)]


def edit(plan: plan_lib.Plan, theta0: dict, vectors: list, key: jax.Array, keep=None,
         dropped=None, totals=None, selected=None, entries=None) -> dict:
  """What `plan` makes of θ0 (floating tensors) and the task vectors over it:
  θ0 + λ·merge(τ_1..τ_N), or merge(τ_1..τ_N) itself where the method writes its vector
  (`merging.Method.writes`); `keep`, the masks of the method's cuts ranked beforehand;
  `dropped`, the vectors after its draws (`merging.sparsity`); `totals`, each tensor's sums
  (`merging.Method.sums`); `selected` and `entries`, each tensor's mask of what the method's
  scores keep and its entry count (`merging.Method.scores`)."""
  method = plan.entry
  reads = {name: value for name, value in (('key', key), ('theta0', theta0))
           if name in method.reads}
  if plan.weights is not None:
    reads['weights'] = list(plan.weights)
  if plan.per_model:
    reads['per_vector'] = {k: list(v) for k, v in plan.per_model}
  if keep is not None:
    reads['keep'] = keep
  if dropped is not None:
    reads['dropped'] = dropped
  for name, value in (('totals', totals), ('selected', selected), ('entries', entries)):
    if value is not None:
      reads[name] = value
  merged = method.merge(vectors, **reads, **plan.settings)
  if method.writes == 'delta':
    return dict(merged.delta)
  return merged.apply_to(theta0, plan.scale)

