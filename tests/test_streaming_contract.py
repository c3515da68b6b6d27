"""A merging method owns its streaming: the streamed engine reads what a method declares
(`merging.sparsity`, `merging.Method`), never its name, so that a method registered here, in
this file alone, streams bit for bit as it merges in memory."""

import inspect
import os
import re

import jax
import ml_dtypes
import numpy as np
import pytest

import merging
from editing import settings
from editing.models import hf
from merging import checkpoints
from merging.checkpoints import digests
from merging.checkpoints import sliced
from merging import common
from merging import ops
from merging import sparsity
from tests import checkpoint_reference as reference
from tests.test_checkpoint_merging import bits, ranked_by_blocks

SCALE = 0.8
# A few tensors, so that the in-memory references compile in moments: two of them span
# several blocks of 64 entries and are ranked by passes over those blocks.
SHAPES = {'model.embed_tokens.weight': (40, 16), 'model.layers.0.mlp.up_proj.weight': (24, 16),
          'model.layers.0.input_layernorm.weight': (16,), 'model.norm.weight': (16,)}


def fixture(root: str, dtype) -> tuple[str, list[str]]:
  """A base and three fine-tunes (base + a small delta) as Hugging Face directories."""
  rng = np.random.default_rng(0)
  config = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}
  base = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
  paths = []
  for k, thetas in enumerate([base] + [{n: x + 0.1 * rng.normal(size=x.shape) for n, x in
                                        base.items()} for _ in range(3)]):
    paths.append(os.path.join(root, f'model{k}'))
    hf.save(paths[-1], {n: x.astype(dtype) for n, x in thetas.items()}, config,
            shard_bytes=2000)
  return paths[0], paths[1:]


def band_sparsity(*, scope: str, **_) -> sparsity.Sparsity:
  """All but the smallest quarter of the magnitudes, less the largest tenth."""
  return sparsity.Sparsity(cut=sparsity.Cut(lambda n: n - n // 4, lambda n: n // 10, scope))


@settings.declare(scope=settings.choice('tensor', ops.SCOPES, 'what the band ranks'))
def band_mean(task_vectors, *, scope, keep=None):
  """The mean of the vectors, each masked to its band (`band_sparsity`)."""
  if keep is None:
    cut = band_sparsity(scope=scope).cut
    keep = [sparsity.kept(v.delta, cut) for v in task_vectors]
  masked = [ops.where(k, v.delta) for k, v in zip(keep, task_vectors)]
  return common.merged(task_vectors, jax.tree.map(lambda *xs: sum(xs) / len(xs), *masked))


def drop_sparsity(*, p: float, rescale: str, **_) -> sparsity.Sparsity:
  """Each entry dropped with probability p, the kept ones rescaled."""
  return sparsity.Sparsity(draw=sparsity.Draw(p, rescale))


@settings.declare(p=settings.number(0.4, '[0, 1)', 'the drop probability'),
                  rescale=settings.choice('probability', ops.RESCALES, 'the rescale'))
def dropped_sum(task_vectors, *, key, p, rescale, dropped=None):
  """The sum of the vectors, each with entries dropped at random (`drop_sparsity`)."""
  if dropped is None:
    dropped = [ops.drop_and_rescale(v.delta, p, ops.vector_key(key, v.tasks), rescale)
               for v in task_vectors]
  return common.merged(task_vectors, jax.tree.map(lambda *xs: sum(xs), *dropped))


@pytest.fixture(name='registered')
def registered_fixture(monkeypatch):
  """The two methods above in `merging.REGISTRY`, for the test's length."""
  monkeypatch.setitem(merging.REGISTRY, 'band_mean',
                      merging.Method(band_mean, sparsity=band_sparsity))
  monkeypatch.setitem(merging.REGISTRY, 'dropped_sum',
                      merging.Method(dropped_sum, reads=('key',), sparsity=drop_sparsity))


def numpy_band(magnitudes: np.ndarray) -> np.ndarray:
  """The band of `band_sparsity` from a stable descending argsort (ties to the earlier)."""
  n = magnitudes.size
  rank = np.empty(n, np.int64)
  rank[np.argsort(-magnitudes.ravel(), kind='stable')] = np.arange(n)
  return ((rank < n - n // 4) & ~(rank < n // 10)).reshape(magnitudes.shape)


@pytest.mark.parametrize('scope, dtype', [('tensor', np.float32),
                                          ('global', ml_dtypes.bfloat16)])
def test_a_method_registered_here_streams_its_cuts_as_it_merges_in_memory(
    tmp_path, monkeypatch, registered, scope, dtype):
  """Its two counts ranked a block at a time (or over each whole model): the in-memory merge's
  bits, and per tensor, the band a numpy argsort keeps."""
  chunks = ranked_by_blocks(monkeypatch)
  base, models = fixture(str(tmp_path), dtype)
  plan = checkpoints.Plan('band_mean', {'scope': scope}, scale=SCALE, shard_bytes=2000)
  assert plan.ranked and plan.global_cut == (scope == 'global') and not plan.whole_tensor
  out = str(tmp_path / 'out')
  checkpoints.merge(base, models, out, plan)
  streamed = reference.read_output(out)
  for n, x in reference.in_memory(base, models, plan).items():
    np.testing.assert_array_equal(bits(streamed[n]), bits(x), err_msg=n)
  if scope == 'global':
    return
  assert any(n > 1 for n in chunks), 'no tensor was ranked a block at a time'
  theta0 = reference.read_output(base)
  deltas = [{n: x - theta0[n] for n, x in reference.read_output(m).items()} for m in models]
  for n, x in theta0.items():
    mean = sum(np.where(numpy_band(np.abs(d[n])), d[n], 0) for d in deltas) / len(deltas)
    np.testing.assert_allclose(streamed[n], x + np.float32(SCALE) * mean, rtol=1e-6,
                               atol=1e-6, err_msg=n)


def test_a_method_registered_here_streams_its_draws_as_it_merges_in_memory(
    tmp_path, monkeypatch, registered):
  """Drawn a block at a time, each entry from its own key: the in-memory merge's bits; an L1
  rescale's norms summed in a pass first, equal up to the float32 sum's rounding."""
  monkeypatch.setattr(checkpoints.pipeline, 'BLOCK', 64)
  base, models = fixture(str(tmp_path), np.float32)
  theta0 = reference.read_output(base)
  for rescale in ops.RESCALES:
    plan = checkpoints.Plan('dropped_sum', {'rescale': rescale}, scale=SCALE, seed=4)
    assert plan.draws and not plan.ranked and plan.elementwise == (rescale == 'probability')
    out = str(tmp_path / rescale)
    checkpoints.merge(base, models, out, plan)
    streamed = reference.read_output(out)
    for n, x in reference.in_memory(base, models, plan).items():
      if rescale == 'probability':
        np.testing.assert_array_equal(bits(streamed[n]), bits(x), err_msg=n)
      else:
        np.testing.assert_allclose(streamed[n], x, rtol=2e-5, atol=1e-6, err_msg=n)
      if x.ndim > 1:  # entries every model dropped: the draws were applied
        assert np.any(streamed[n] == theta0[n]), n


@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16], ids=['fp32', 'bf16'])
def test_negation_and_extract_are_their_formulas(tmp_path, dtype):
  """θ0 − λ·(θ1 − θ0) in the base's dtype, and θ1 − θ0 in float32, from plain numpy."""
  base, models = fixture(str(tmp_path), dtype)
  theta0, theta1 = reference.read_output(base), reference.read_output(models[0])
  checkpoints.merge(base, models[:1], str(tmp_path / 'negated'),
                    checkpoints.Plan('negation', {}, scale=0.5))
  checkpoints.merge(base, models[:1], str(tmp_path / 'extracted'),
                    checkpoints.Plan('extract', {}, scale=0.5))
  negated = reference.read_output(str(tmp_path / 'negated'))
  extracted = reference.read_output(str(tmp_path / 'extracted'))
  eps = float(ml_dtypes.finfo(dtype).eps)
  for n, x in theta0.items():
    tau = theta1[n].astype(np.float32) - x.astype(np.float32)
    expected = x.astype(np.float32) - np.float32(0.5) * tau
    assert negated[n].dtype == dtype and extracted[n].dtype == np.float32, n
    # One rounding to the output's dtype, which may round a fused multiply-add either way.
    np.testing.assert_allclose(negated[n].astype(np.float32), expected, rtol=eps, atol=1e-7,
                               err_msg=n)
    np.testing.assert_array_equal(extracted[n], tau, err_msg=n)


def test_every_sparsifying_method_takes_what_the_engine_finds_for_it():
  """A method that declares cuts takes their masks as `keep`; one that declares draws takes
  the vectors after them as `dropped`: the engine passes them by what is declared."""
  for name, method in merging.REGISTRY.items():
    if method.sparsity is None:
      continue
    inner = getattr(method.merge, 'func', method.merge)
    parameters = inspect.signature(inner).parameters
    declared = method.sparsity(**{k: s.default for k, s in method.settings.items()})
    assert declared.cut is None or 'keep' in parameters, name
    assert declared.draw is None or 'dropped' in parameters, name


def test_the_streamed_engine_names_no_method():
  """No file of `merging.checkpoints` quotes the name of a method of `merging.REGISTRY`."""
  package = os.path.dirname(checkpoints.__file__)
  for file in sorted(os.listdir(package)):
    if not file.endswith('.py'):
      continue
    with open(os.path.join(package, file)) as f:
      text = f.read()
    for name in merging.REGISTRY:
      assert not re.search(rf'''['"]{re.escape(name)}['"]''', text), (file, name)


def test_the_engines_readers_are_hf_readers(tmp_path):
  """A checkpoint, a slice's view of it and a hashed reader all read as `hf.Reader` says, and a
  view reads its source's entries under the output's names."""
  base, _ = fixture(str(tmp_path), np.float32)
  ckpt = hf.Checkpoint(base)
  name = sorted(ckpt.files)[0]
  view = sliced.View(ckpt, {'renamed': name}, layers=1)
  for reader in (ckpt, view, digests.Watched(ckpt)):
    assert isinstance(reader, hf.Reader), type(reader)
  assert not isinstance(np.zeros(3), hf.Reader)
  np.testing.assert_array_equal(view.read('renamed', 0, 5), ckpt.read(name, 0, 5))
  assert view.header('renamed') == ckpt.header(name)
