"""Merging Hugging Face checkpoints of any size, a tensor at a time, through `merging`'s methods.

A base checkpoint θ0 and N fine-tuned checkpoints of the same architecture (any: an LLM, a ViT)
are read lazily (`editing.models.hf.Checkpoint`, a tensor at a time, `prefetch` + 1 tensors in
memory at most). For every tensor name, in sorted order, the N deltas τ_t = θ_t − θ0 (in
float32) become one-leaf task vectors, the configured method merges them (the same function the
suite's merges call; DARE's randomness is keyed by the tensor's name, so the bits depend neither
on order nor on sharding), and θ0 + λ·τ_m is written in θ0's dtype:

  averaging, task_arithmetic, ties, dare, breadcrumbs, consensus
                 θ0 + λ·merge(τ_1..τ_N)
  negation       θ0 − λ·τ_1 (one fine-tuned model)
  extract        τ_1 itself, in float32 (one fine-tuned model)

Each tensor's merge is one jitted program, shared by every tensor of its shape (DARE's runs op
by op: its draws are keyed by the tensor's name); the masks a method ranks (TIES' top-k,
Breadcrumbs' band) are ranked on the host beforehand, and TIES with scope 'global' (alone or
after DARE) ranks each model's magnitudes over all its tensors: two counting passes find the
exact threshold first (`_GlobalRanking`). The merge runs on all local devices, split along the
tensor's first dimension the device count divides, and `prefetch` tensors are read and merged in
threads while one is written.
Methods that read data (Fisher, RegMean, AdaMerging, DAM) are refused. The output is a Hugging
Face directory: safetensors shards of at most `shard_bytes` with their index, and the base's
config.json and tokenizer files. It is built in `<output>.partial/`, each shard written to a
temporary name and renamed, and the directory renamed into place at the end; the shard plan is
a pure function of the inputs, so a run killed at any point and rerun keeps the finished shards
and writes the same bytes as an uninterrupted run.
"""

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import os
import shutil
import time
from typing import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
from absl import logging

import merging
from editing import checkpoint
from editing import sharding
from editing import tree as tree_lib
from editing.errors import UserError
from editing.models import hf
from editing.task_vector import TaskVector
from merging import dare
from merging import ops
from merging.jobs import mergekit

DATA_FREE = ('averaging', 'task_arithmetic', 'ties', 'dare', 'breadcrumbs', 'consensus')
SINGLE_MODEL = ('negation', 'extract')
METHODS = DATA_FREE + SINGLE_MODEL
# The methods that take per-model weights (and `normalize`), as mergekit's do.
WEIGHTED = ('task_arithmetic', 'ties', 'dare')
_LEAF = 'tensor'  # the name of the one leaf a tensor's jitted merge sees
# DARE draws each tensor's masks from a key folded with the tensor's name: jitted, it would
# compile a program per tensor (2.4× slower end to end on the benchmark's fixture), so it runs
# op by op under the tensor's own name, in the streamed merge and in the in-memory reference.
_OP_BY_OP = ('dare',)
_OUTPUT_DTYPES = {'float32': np.dtype(np.float32), 'bfloat16': np.dtype(ml_dtypes.bfloat16),
                  'float16': np.dtype(np.float16)}
_COPIED = ('config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json',
           'special_tokens_map.json', 'tokenizer.model', 'vocab.txt', 'vocab.json', 'merges.txt')


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a merge does: the method, its settings, λ and the output's shard size."""

  method: str
  settings: dict
  scale: float = 1.0  # λ
  seed: int = 0  # DARE's key
  shard_bytes: int = 2 * 1024**3
  allow_nonfinite: bool = False
  weights: tuple[float, ...] | None = None  # per fine-tuned model, in order
  dtype: str | None = None  # of the merged floating tensors; default the base's
  # Tensors read and merged ahead, each in a thread, while one is written: more is faster up
  # to the cores there are, and holds that many more tensors' inputs in memory.
  prefetch: int = 2

  def __hash__(self):  # a static argument of the jitted per-tensor merge
    return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v
                      for v in dataclasses.astuple(self)))

  def __post_init__(self):
    if self.method not in METHODS:
      reads = merging.REGISTRY.get(self.method)
      if reads is not None:
        raise UserError(f'{self.method} reads data ({", ".join(reads.reads)}); checkpoint '
                        f'merging runs only the data-free methods {METHODS}')
      raise UserError(f'unknown checkpoint merge method {self.method!r}; known: {METHODS}')
    if self.global_ties and self.allow_nonfinite:
      raise UserError("ties with scope='global' ranks finite magnitudes only; it cannot "
                      'allow non-finite inputs')
    if self.shard_bytes < 1:
      raise UserError(f'shard_bytes = {self.shard_bytes}: must be positive')
    if self.prefetch < 1:
      raise UserError(f'prefetch = {self.prefetch}: must be at least 1')
    if self.weights is not None and self.method not in WEIGHTED:
      raise UserError(f'{self.method} takes no per-model weights; the methods that do: '
                      f'{WEIGHTED}')
    if self.dtype is not None and self.dtype not in _OUTPUT_DTYPES:
      raise UserError(f'dtype {self.dtype!r}: the output can be written in one of '
                      f'{sorted(_OUTPUT_DTYPES)}')

  @property
  def global_ties(self) -> bool:
    """TIES (alone or after DARE) ranking each model's magnitudes as a whole: counting passes
    come first."""
    ties_follows = self.method == 'ties' or (self.method == 'dare' and
                                             self.settings.get('then') == 'ties')
    return ties_follows and self.settings.get('scope', 'global') == 'global'


def merge(base: str, models: Sequence[str], output: str, plan: Plan) -> dict:
  """Merges `models` onto `base` into the Hugging Face directory `output`; returns a summary."""
  if plan.method in SINGLE_MODEL and len(models) != 1:
    raise UserError(f'{plan.method} takes exactly one fine-tuned model, got {len(models)}')
  if not models:
    raise UserError('no fine-tuned model to merge')
  if plan.weights is not None and len(plan.weights) != len(models):
    raise UserError(f'{len(plan.weights)} weights for {len(models)} fine-tuned models: give one '
                    'per model, in order')
  base_ckpt = hf.Checkpoint(base)
  ckpts = [hf.Checkpoint(m) for m in models]
  names = sorted(base_ckpt.files)
  for path, ckpt in zip(models, ckpts):
    missing = sorted(set(names) - set(ckpt.files))
    extra = sorted(set(ckpt.files) - set(names))
    if missing or extra:
      raise UserError(f'{path} does not have the tensors of {base}: missing {missing[:5]}'
                      f'{"..." if len(missing) > 5 else ""}, extra {extra[:5]}'
                      f'{"..." if len(extra) > 5 else ""}')
  shards = _shards(base_ckpt, names, plan)
  labels = tuple(f'model_{i}' for i in range(len(models)))
  key = jax.random.PRNGKey(plan.seed)
  # Before anything is written: the counting passes read every tensor.
  rankings = ([_GlobalRanking(base_ckpt, ckpt, names, _setting(plan, 'density'),
                              _ranked(plan, label, key))
               for ckpt, label in zip(ckpts, labels)] if plan.global_ties else None)
  mesh = sharding.make_mesh()
  partial = output.rstrip('/') + '.partial'
  os.makedirs(partial, exist_ok=True)
  start, done_bytes, total_bytes = time.time(), 0, sum(s['bytes'] for s in shards)
  done_tensors = 0
  for shard in shards:
    path = os.path.join(partial, shard['file'])
    if not os.path.exists(path):
      merged = _ahead(lambda name: _merge_tensor(name, base_ckpt, ckpts, models, labels, key,
                                                 plan, mesh, rankings), shard['names'],
                      plan.prefetch)
      with contextlib.closing(merged):
        checkpoint.write_safetensors(path, shard['entries'], lambda name: next(merged)[name],
                                     metadata={'format': 'pt'})
    done_bytes += shard['bytes']
    done_tensors += len(shard['names'])
    rate = done_bytes / max(time.time() - start, 1e-9)
    logging.info('%s: %d/%d tensors, %.0f tensors/s, %.1f MB/s, eta %.0f s', shard['file'],
                 done_tensors, len(names), done_tensors / max(time.time() - start, 1e-9),
                 rate / 1e6, (total_bytes - done_bytes) / max(rate, 1e-9))
  _finish(base, partial, output, shards)
  return {'output': output, 'tensors': len(names), 'shards': len(shards),
          'bytes': total_bytes, 'seconds': time.time() - start}


def _ahead(produce: Callable[[str], np.ndarray], names: Iterable[str],
           depth: int) -> Iterator[dict[str, np.ndarray]]:
  """{name: produce(name)} for each name in order, the next `depth` produced in threads of
  their own while the caller writes the current one: writes, reads, host rankings and XLA
  programs overlap (numpy, file reads and XLA release the GIL), at the memory of `depth` more
  tensors."""
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=depth)
  try:
    pending = collections.deque()
    for name in names:
      pending.append((name, pool.submit(produce, name)))
      if len(pending) > depth:
        done, future = pending.popleft()
        yield {done: future.result()}
    while pending:
      done, future = pending.popleft()
      yield {done: future.result()}
  finally:
    # After an error or an interrupt, the merges not yet started are dropped, not run.
    pool.shutdown(wait=True, cancel_futures=True)


def _shards(base: hf.Checkpoint, names: list[str], plan: Plan) -> list[dict]:
  """Consecutive names grouped into shards of at most plan.shard_bytes of output."""
  shards: list[dict] = []
  for name in names:
    shape, dtype = _header(base, name)
    # τ is written in float32; merged weights in the plan's dtype, else the base's.
    if jnp.issubdtype(dtype, jnp.floating):
      dtype = _output_dtype(plan, dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if not shards or (shards[-1]['bytes'] + nbytes > plan.shard_bytes and shards[-1]['names']):
      shards.append({'names': [], 'entries': [], 'bytes': 0})
    shards[-1]['names'].append(name)
    shards[-1]['entries'].append((name, shape, dtype))
    shards[-1]['bytes'] += nbytes
  for i, shard in enumerate(shards):
    shard['file'] = (hf.SINGLE if len(shards) == 1 else
                     f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors')
  return shards


def _output_dtype(plan: Plan, base_dtype: np.dtype) -> np.dtype:
  """The dtype a floating tensor is written in."""
  if plan.method == 'extract':
    return np.dtype(np.float32)
  return _OUTPUT_DTYPES[plan.dtype] if plan.dtype else np.dtype(base_dtype)


def _header(ckpt: hf.Checkpoint, name: str) -> tuple[tuple[int, ...], np.dtype]:
  """A tensor's shape and numpy dtype, from the file's header alone."""
  with safetensors.safe_open(ckpt.files[name], framework='numpy') as f:
    sliced = f.get_slice(name)
    code = sliced.get_dtype()
    if code not in checkpoint.DTYPES:
      raise UserError(f'{ckpt.files[name]}: {name} has dtype {code}, which is not merged here')
    return tuple(sliced.get_shape()), checkpoint.DTYPES[code]


def _ranked(plan: Plan, label: str, key: jax.Array) -> Callable:
  """ranked(name, τ): what TIES ranks of one model's tensor, τ itself, or after DARE its
  dropped and rescaled τ̃ (the same bits `dare.merge` draws for it)."""
  def ranked(name: str, delta) -> np.ndarray:
    if plan.method == 'dare':
      vector = TaskVector({name: jnp.asarray(delta)}, (label,), 'full', 'streamed')
      delta = dare.drop([vector], _setting(plan, 'p'), key)[0].delta[name]
    return np.asarray(delta, np.float32)
  return ranked


class _GlobalRanking:
  """One model's exact top-k of |τ| over all its floating tensors, found by counting, so that
  each tensor's mask is computed alone and equals the in-memory global ranking's.

  |τ| is non-negative float32, so its bit patterns, read as uint32, order as its values. A
  pass counts the top 16 bits of every entry, which finds the 2^16-wide bucket holding the
  kept-th largest value; a second pass counts the low bits inside that bucket, which finds
  the value v itself, and records per tensor how many entries equal v. A tensor's mask is then
  |τ| > v, plus the entries equal to v while the running count of them, in tensor order then
  row-major, stays within what the top-k has left: ties go to the earlier entry, as
  `editing.tree.top_k` breaks them.
  """

  def __init__(self, base: hf.Checkpoint, tuned: hf.Checkpoint, names: Sequence[str],
               density: float, ranked: Callable[[str, np.ndarray], np.ndarray]):
    if not 0 < density <= 1:
      raise UserError(f'density must be in (0, 1], got {density}')
    self.names = [n for n in names if _is_floating(base, n)]
    self._ranked = ranked
    delta = lambda name: _host_delta(tuned.tensor(name), base.tensor(name))
    high = np.zeros(1 << 16, np.int64)
    total = 0
    for name in self.names:
      bits = self._bits(name, delta(name))
      high += np.bincount(bits >> 16, minlength=1 << 16)
      total += bits.size
    self.kept = max(1, int(density * total))
    from_top = np.cumsum(high[::-1])
    bucket = (1 << 16) - 1 - int(np.searchsorted(from_top, self.kept))
    above_bucket = int(high[bucket + 1:].sum())
    low = np.zeros(1 << 16, np.int64)
    in_bucket = {}
    for name in self.names:
      bits = self._bits(name, delta(name))
      values, counts = np.unique(bits[(bits >> 16) == bucket] & 0xFFFF, return_counts=True)
      in_bucket[name] = dict(zip(values.tolist(), counts.tolist()))
      low[values] += counts
    from_top = np.cumsum(low[::-1])
    low_bits = (1 << 16) - 1 - int(np.searchsorted(from_top, self.kept - above_bucket))
    self.value = np.uint32((bucket << 16) | low_bits)
    self.above = above_bucket + int(low[low_bits + 1:].sum())
    ties = [in_bucket[n].get(low_bits, 0) for n in self.names]
    self.ties_before = dict(zip(self.names, np.cumsum([0] + ties[:-1]).tolist()))

  def _bits(self, name: str, delta) -> np.ndarray:
    return np.abs(self._ranked(name, delta)).ravel().view(np.uint32)

  def mask(self, name: str, delta) -> np.ndarray:
    """The kept entries of the tensor `name`, whose τ is `delta`."""
    bits = self._bits(name, delta)
    ties = bits == self.value
    allowed = self.kept - self.above - self.ties_before[name]
    keep = (bits > self.value) | (ties & (np.cumsum(ties) <= allowed))
    return keep.reshape(np.shape(delta))


def _is_floating(ckpt: hf.Checkpoint, name: str) -> bool:
  return bool(jnp.issubdtype(_header(ckpt, name)[1], jnp.floating))


def _merge_tensor(name, base_ckpt, ckpts, models, labels, key, plan, mesh,
                  rankings=None) -> np.ndarray:
  base = base_ckpt.tensor(name)
  thetas = [c.tensor(name) for c in ckpts]
  for path, theta in zip(models, thetas):
    if theta.shape != base.shape or theta.dtype != base.dtype:
      raise UserError(f'{path}: {name} is {theta.dtype}{list(theta.shape)}, the base '
                      f'{base.dtype}{list(base.shape)}')
  if not jnp.issubdtype(base.dtype, jnp.floating):
    return base  # integer buffers (position ids, masks) are not weights, and always finite
  placed = _split(mesh, base.shape)
  if plan.method in _OP_BY_OP:
    _check_finite(plan, name, [base_ckpt.path] + list(models),
                  [tree_lib.first_nonfinite({name: x}) is None for x in [base] + thetas])
    theta0 = {name: jax.device_put(base, placed)}
    vectors = _task_vectors(theta0, [{name: jax.device_put(t, placed)} for t in thetas], labels)
    keep = (None if rankings is None else
            [{name: r.mask(name, v.delta[name])} for r, v in zip(rankings, vectors)])
    edited = _edit(plan, theta0, vectors, key, keep)[name]
    return np.asarray(edited).astype(_output_dtype(plan, base.dtype), copy=False)
  edited, finite = _jitted_edit(plan, jax.device_put(base, placed),
                                [jax.device_put(t, placed) for t in thetas],
                                _masks(plan, name, base, thetas, rankings))
  _check_finite(plan, name, [base_ckpt.path] + list(models), np.asarray(finite))
  # Cast here, from the dtype as stored: JAX without x64 would see float64 as float32.
  return np.asarray(edited).astype(_output_dtype(plan, base.dtype), copy=False)


def _masks(plan, name, base, thetas, rankings) -> list | None:
  """The masks a method ranks for each fine-tuned model's tensor, ranked here on the host
  (numpy's selection; a sort inside the jitted merge is far slower on a CPU): TIES' top-k
  (per tensor, or from the global rankings), Breadcrumbs' band; None for the other methods."""
  if plan.method not in ('ties', 'breadcrumbs'):
    return None
  deltas = [_host_delta(t, base) for t in thetas]
  if rankings is not None:
    return [{_LEAF: r.mask(name, d)} for r, d in zip(rankings, deltas)]
  if plan.method == 'breadcrumbs':
    return [ops.keep_band({_LEAF: d}, _setting(plan, 'top'), _setting(plan, 'bottom'))
            for d in deltas]
  return [ops.keep_largest({_LEAF: d}, _setting(plan, 'density'), 'tensor') for d in deltas]


def _host_delta(theta: np.ndarray, base: np.ndarray) -> np.ndarray:
  """τ = θ − θ0 in float32 on the host, the values the host rankings read."""
  return theta.astype(np.float32, copy=False) - base.astype(np.float32, copy=False)


def _setting(plan: Plan, key: str):
  """The plan's value of a setting of its method, else the method's own default."""
  if key in plan.settings:
    return plan.settings[key]
  return inspect.signature(merging.get(plan.method).merge).parameters[key].default


def _check_finite(plan: Plan, name: str, paths: Sequence[str], finite: Sequence[bool]) -> None:
  """An error naming the first input whose tensor `name` holds a NaN or an infinity, unless the
  plan allows them."""
  for path, ok in zip(paths, finite):
    if not ok and not plan.allow_nonfinite:
      raise UserError(f'{path}: {name} holds non-finite values (NaN or infinity); pass '
                      'allow_nonfinite to merge it anyway')


@functools.partial(jax.jit, static_argnums=0)
def _jitted_edit(plan: Plan, base: jax.Array, thetas: list, keep: list | None):
  """One tensor's edit as one XLA program, compiled once per shape and dtype (the tensor is the
  one leaf `_LEAF`, whatever its name): what `_edit` makes of it, and whether each input is
  finite."""
  vectors = _task_vectors({_LEAF: base}, [{_LEAF: t} for t in thetas],
                          [f'model_{i}' for i in range(len(thetas))])
  edited = _edit(plan, {_LEAF: base}, vectors, None, keep)[_LEAF]
  finite = jnp.stack([jnp.isfinite(x).all() for x in [base] + list(thetas)])
  return edited, finite


def _split(mesh: jax.sharding.Mesh, shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
  """A tensor's placement: its first dimension that the device count divides is split over all
  devices (every method is elementwise or ranks on the host, so the bits do not change), or
  it is replicated."""
  for d, size in enumerate(shape):
    if size % mesh.size == 0:
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
          *[None] * d, sharding.MESH_AXES))
  return sharding.replicated(mesh)


def _task_vectors(theta0: dict, tuned: Sequence[dict], labels: Sequence[str]) -> list:
  """τ_t = θ_t − θ0 in float32, one vector per fine-tuned model, over θ0's names."""
  return [TaskVector({n: jnp.asarray(theta[n], jnp.float32) - jnp.asarray(x, jnp.float32)
                      for n, x in theta0.items()}, (label,), 'full', 'streamed')
          for theta, label in zip(tuned, labels)]


def _edit(plan: Plan, theta0: dict, vectors: list, key: jax.Array, keep=None) -> dict:
  """What `plan` makes of θ0 (floating tensors) and the task vectors over it: τ_1 (extract),
  θ0 − λ·τ_1 (negation), or θ0 + λ·merge(τ_1..τ_N); `keep`, TIES' masks ranked beforehand."""
  if plan.method == 'extract':
    return dict(vectors[0].delta)
  if plan.method == 'negation':
    merged, scale = vectors[0], -plan.scale
  else:
    method = merging.get(plan.method)
    reads = {'key': key} if 'key' in method.reads else {}
    if plan.weights is not None:
      reads['weights'] = list(plan.weights)
    if keep is not None:
      reads['keep'] = keep
    merged, scale = method.merge(vectors, **reads, **plan.settings), plan.scale
  return merged.apply_to(theta0, scale)


def _finish(base: str, partial: str, output: str, shards: list[dict]) -> None:
  if len(shards) > 1:
    index = {'metadata': {'total_size': sum(s['bytes'] for s in shards)},
             'weight_map': {n: s['file'] for s in shards for n in s['names']}}
    checkpoint.atomic_write_json(os.path.join(partial, hf.INDEX), index)
  if os.path.isdir(base):
    for name in _COPIED:
      if os.path.exists(os.path.join(base, name)):
        shutil.copy(os.path.join(base, name), os.path.join(partial, name))
  if os.path.exists(output):
    shutil.rmtree(output)
  os.replace(partial, output)
  logging.info('merged checkpoint in %s', output)


def in_memory(base: str, models: Sequence[str], plan: Plan) -> dict[str, np.ndarray]:
  """The same merge over whole models at once, ranking inside it: the reference the streamed
  result must equal. Jitted as the streamed merge is (DARE op by op, as it is there): XLA
  contracts a·b + c into one fused multiply-add and divides by a constant as a multiply by its
  reciprocal, so an op-by-op merge and a jitted one may differ in the last bit."""
  base_ckpt = hf.Checkpoint(base)
  stored = {n: base_ckpt.tensor(n) for n in base_ckpt.files}
  floats = {n: jnp.asarray(x) for n, x in stored.items() if jnp.issubdtype(x.dtype, jnp.floating)}
  tuned = [{n: ckpt.tensor(n) for n in floats} for ckpt in map(hf.Checkpoint, models)]
  labels = [f'model_{i}' for i in range(len(models))]
  edit = _edit if plan.method in _OP_BY_OP else jax.jit(_edit, static_argnums=0)
  edited = edit(plan, floats, _task_vectors(floats, tuned, labels), jax.random.PRNGKey(plan.seed))
  return {**stored, **{n: np.asarray(x).astype(_output_dtype(plan, stored[n].dtype), copy=False)
                       for n, x in edited.items()}}


def read_output(output: str) -> dict[str, np.ndarray]:
  ckpt = hf.Checkpoint(output)
  return {n: ckpt.tensor(n) for n in ckpt.files}


def run(config, workdir: str) -> dict:
  """The launch job: `config` as configs/merge_checkpoints.py describes it (or the mergekit
  YAML `config.mergekit` names); the output defaults to <workdir>/merged."""
  if config.mergekit:
    config = mergekit.apply(config, config.mergekit)
  models = [m.strip() for m in config.models.split(',') if m.strip()]
  section = config.get(config.method)
  try:
    weights = (tuple(float(w) for w in config.weights.split(',')) if config.weights.strip()
               else None)
  except ValueError:
    raise UserError(f'config.weights = {config.weights!r}: comma-separated numbers, one per '
                    'model') from None
  plan = Plan(config.method, section.to_dict() if section is not None else {},
              scale=config.scale, seed=config.seed, shard_bytes=config.shard_bytes,
              allow_nonfinite=config.allow_nonfinite, weights=weights,
              dtype=config.dtype or None, prefetch=config.prefetch)
  if not config.base:
    raise UserError('config.base: give the base checkpoint (a Hugging Face directory or a '
                    '.safetensors file)')
  return merge(config.base, models, config.output or os.path.join(workdir, 'merged'), plan)
