"""Streaming checkpoint merges: equal to the in-memory merge bit for bit, resumable after a
crash to the same bytes, and every bad input named with nothing written."""

import hashlib
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

import merging
from editing import cuts
from editing.errors import UserError
from editing.models import hf
from merging import arcee_fusion
from merging import checkpoints
from merging import lines
from merging import ops
from merging.checkpoints import pipeline
from merging.checkpoints import ranking
from merging.checkpoints import tensors
from tests import checkpoint_reference as reference
from tests.conftest import xla_flags

LAYERS = 2
HIDDEN = 16


def llama_tensors(seed, dtype=np.float32):
  """A small Llama-shaped state dict (its names and shapes, tiny sizes)."""
  rng = np.random.default_rng(seed)
  shapes = {'model.embed_tokens.weight': (50, HIDDEN), 'model.norm.weight': (HIDDEN,),
            'lm_head.weight': (50, HIDDEN)}
  for i in range(LAYERS):
    for name, shape in {'self_attn.q_proj.weight': (HIDDEN, HIDDEN),
                        'self_attn.k_proj.weight': (8, HIDDEN),
                        'self_attn.v_proj.weight': (8, HIDDEN),
                        'self_attn.o_proj.weight': (HIDDEN, HIDDEN),
                        'mlp.gate_proj.weight': (32, HIDDEN), 'mlp.up_proj.weight': (32, HIDDEN),
                        'mlp.down_proj.weight': (HIDDEN, 32),
                        'input_layernorm.weight': (HIDDEN,),
                        'post_attention_layernorm.weight': (HIDDEN,)}.items():
      shapes[f'model.layers.{i}.{name}'] = shape
  return {n: rng.normal(size=s).astype(dtype) for n, s in shapes.items()}


def fixture(root, dtype=np.float32, shard_bytes=10**9):
  """base and three fine-tunes (base + a small delta) as Hugging Face directories."""
  base = llama_tensors(0, dtype)
  config = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}
  hf.save(os.path.join(root, 'base'), base, config, shard_bytes=shard_bytes)
  models = []
  for k in range(3):
    delta = llama_tensors(k + 1, np.float32)
    tuned = {n: (x.astype(np.float32) + 0.1 * delta[n]).astype(dtype) for n, x in base.items()}
    models.append(os.path.join(root, f'ft{k}'))
    hf.save(models[-1], tuned, config, shard_bytes=shard_bytes)
  return os.path.join(root, 'base'), models


PLANS = {
    'averaging': checkpoints.Plan('averaging', {}),
    'task_arithmetic': checkpoints.Plan('task_arithmetic', {}, scale=0.7, prefetch=1),
    'ties': checkpoints.Plan('ties', {'density': 0.2, 'scope': 'tensor'}, scale=0.9),
    'ties_global': checkpoints.Plan('ties', {'density': 0.2, 'scope': 'global'}, scale=0.9,
                                    shard_bytes=2500),
    'dare': checkpoints.Plan('dare', {'p': 0.5, 'then': 'ties', 'density': 0.3,
                                      'scope': 'tensor'}, seed=3),
    'dare_global': checkpoints.Plan('dare', {'p': 0.5, 'then': 'ties', 'density': 0.3,
                                             'scope': 'global'}, seed=3, shard_bytes=2500),
    # mergekit's rescale: each tensor's dropped deltas back to its L1 norm, before the ranking.
    'dare_l1_global': checkpoints.Plan('dare', {'p': 0.5, 'then': 'ties', 'density': 0.3,
                                                'scope': 'global', 'rescale': 'l1_norm'},
                                       seed=3, shard_bytes=2500),
    # DARE then task arithmetic, or TIES keeping every entry (mergekit's dare_ties), merge a
    # block at a time; an L1 rescale sums the tensor's norms in a pass before.
    'dare_linear': checkpoints.Plan('dare', {'p': 0.5, 'then': 'task_arithmetic'}, seed=3,
                                    per_model=(('p', (0.3, 0.5, 0.0)),)),
    'dare_ties_l1': checkpoints.Plan('dare', {'p': 0.6, 'then': 'ties', 'density': 1.0,
                                              'scope': 'tensor', 'rescale': 'l1_norm'}, seed=3),
    # mergekit's per-model densities (one model keeping everything, its count fixed).
    'ties_per_model': checkpoints.Plan('ties', {'density': 0.2, 'scope': 'tensor'}, scale=0.9,
                                       per_model=(('density', (0.1, 0.5, 1.0)),)),
    'dare_per_model_global': checkpoints.Plan(
        'dare', {'p': 0.5, 'then': 'ties', 'density': 0.3, 'scope': 'global'}, seed=3,
        shard_bytes=2500, per_model=(('density', (0.3, 0.6, 0.2)), ('p', (0.2, 0.5, 0.7)))),
    'breadcrumbs': checkpoints.Plan('breadcrumbs', {'top': 0.05, 'bottom': 0.5}),
    'consensus': checkpoints.Plan('consensus', {'min_tasks': 2, 'tall_lambda': 0.5}),
    'magmax': checkpoints.Plan('magmax', {}, scale=0.5),
    'tsv_m': checkpoints.Plan('tsv_m', {}, scale=1.5),
    'iso_c': checkpoints.Plan('iso_c', {}),
    'iso_cts': checkpoints.Plan('iso_cts', {'common_space_fraction': 0.5}),
    'wudi': checkpoints.Plan('wudi', {'steps': 20, 'learning_rate': 1e-3}),
    'model_stock': checkpoints.Plan('model_stock', {}),
    'della': checkpoints.Plan('della', {'density': 0.4, 'epsilon': 0.2}, scale=0.8, seed=5),
    # mergekit's della: MagPrune's draws rescaled to each tensor's L1 norm, by a pass before.
    'della_l1': checkpoints.Plan('della', {'density': 0.4, 'epsilon': 0.2,
                                           'rescale': 'l1_norm'}, seed=5),
    'sce': checkpoints.Plan('sce', {'select_topk': 0.5}),
    'sce_all': checkpoints.Plan('sce', {'select_topk': 1.0}),  # mergekit's default
    'slerp': checkpoints.Plan('slerp', {'t': 0.3}),
    'nuslerp': checkpoints.Plan('nuslerp', {'flatten': False}, weights=(1.0, 3.0)),
    'nuslerp_flat': checkpoints.Plan('nuslerp', {}, weights=(1.0, 3.0)),
    'multislerp': checkpoints.Plan('multislerp', {}, weights=(1.0, 2.0, 1.0)),
    'karcher': checkpoints.Plan('karcher', {}),
    'nearswap': checkpoints.Plan('nearswap', {'t': 0.01}),
    'arcee_fusion': checkpoints.Plan('arcee_fusion', {}),
}


# Merges whose streamed sums over a tensor (L1 norms; the spherical merges' and Model Stock's
# norms and dot products; SCE's energies) are added a block at a time on the host (in float64), where the
# in-memory merge sums the whole tensor in float32, in an order the compiler picks: a float32
# sum of n terms is within (n − 1)·eps of its value, relatively, so the factors made of them (a
# ratio of two such sums, a cosine) agree to within about 2n·eps, and so do the merged weights
# they scale.
ROUNDED = ('dare_ties_l1', 'della_l1', 'karcher', 'model_stock', 'multislerp', 'nuslerp_flat',
           'sce', 'sce_all', 'slerp')


def assert_merged_equal(name, streamed, expected, err_msg):
  """Bit for bit, or for ROUNDED merges within the float32 summation bound above, relative to
  the tensor's largest magnitude."""
  if name not in ROUNDED:
    np.testing.assert_array_equal(bits(streamed), bits(expected), err_msg=err_msg)
    return
  assert streamed.dtype == expected.dtype, err_msg
  expected = expected.astype(np.float32)
  # A weight stored in bfloat16 may also round to the neighbour of the other's.
  relative = max(2 * expected.size * float(np.finfo(np.float32).eps),
                 float(ml_dtypes.finfo(streamed.dtype).eps))
  np.testing.assert_allclose(streamed.astype(np.float32), expected, rtol=0,
                             atol=relative * float(np.abs(expected).max(initial=0)),
                             err_msg=err_msg)


def fixed_count(name, models):
  """The first of `models`, as many as the plan's method takes where that is fixed."""
  plan = PLANS.get(name)
  count = 1 if plan is None else merging.get(plan.method).vectors
  return models if count is None else models[:count]


def bits(x):
  return np.ascontiguousarray(x).view(np.uint8)


# Every method in bfloat16, whose roundings tie and reorder most; in float32 one method of each
# way of reading a tensor (a block at a time, ranked per tensor or over all, drawn, whole, an
# L1 rescale) and the two whose outputs are not a merge.
FLOAT32_TOO = ('task_arithmetic', 'ties', 'ties_global', 'dare', 'dare_ties_l1', 'tsv_m',
               'slerp', 'karcher', 'negation', 'extract')


@pytest.mark.parametrize('name, dtype', [
    (name, dtype) for name in sorted(PLANS) + ['negation', 'extract']
    for dtype in ([np.float32] if name in FLOAT32_TOO else []) + [ml_dtypes.bfloat16]],
    ids=lambda x: {np.float32: 'fp32', ml_dtypes.bfloat16: 'bf16'}.get(x, x))
def test_streamed_merge_equals_the_in_memory_merge_bit_for_bit(tmp_path, name, dtype):
  base, models = fixture(str(tmp_path), dtype, shard_bytes=3000)
  plan = PLANS.get(name) or checkpoints.Plan(name, {}, scale=0.5, shard_bytes=2000)
  models = fixed_count(name, models)
  out = str(tmp_path / 'out')
  summary = checkpoints.merge(base, models, out, plan)
  streamed = reference.read_output(out)
  expected = reference.in_memory(base, models, plan)
  assert streamed.keys() == expected.keys() and summary['tensors'] == len(expected)
  for n, x in expected.items():
    assert streamed[n].dtype == (np.float32 if name == 'extract' else dtype), n
    assert_merged_equal(name, streamed[n], x, n)
  assert os.path.exists(os.path.join(out, 'config.json'))
  assert not os.path.exists(out + '.partial')


# A method that merges each tensor whole writes it in blocks as any other does: one of them
# (TSV-M) stands for all here; the bit-for-bit test above merges each.
IN_BLOCKS = sorted(n for n in PLANS if n == 'tsv_m' or not PLANS[n].whole_tensor)


@pytest.mark.parametrize('name', IN_BLOCKS)
def test_tensors_merged_in_many_blocks_equal_the_in_memory_merge(tmp_path, monkeypatch, name):
  """Blocks of 64 entries: every tensor but the norms spans several, the last one padded, and
  each ranked mask is drawn from its cut a block at a time (bf16, whose deltas tie often)."""
  monkeypatch.setattr(pipeline, 'BLOCK', 64)
  base, models = fixture(str(tmp_path), ml_dtypes.bfloat16, shard_bytes=3000)
  models = fixed_count(name, models)
  out = str(tmp_path / 'out')
  checkpoints.merge(base, models, out, PLANS[name])
  streamed = reference.read_output(out)
  for n, x in reference.in_memory(base, models, PLANS[name]).items():
    assert_merged_equal(name, streamed[n], x, n)


def test_multislerp_directions_that_cancel_are_refused_by_the_tensors_name(tmp_path):
  """Task vectors d, −d, d weighted 1, 2, 1: their weighted mean direction is zero. The Gram
  summed over the tensor's blocks says so before any block merges under jit."""
  config = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}
  base = {'model.norm.weight': np.ones(8, np.float32)}
  d = np.linspace(-1, 1, 8, dtype=np.float32)
  paths = []
  for k, sign in enumerate((1, -1, 1)):
    paths.append(str(tmp_path / f'ft{k}'))
    hf.save(paths[-1], {'model.norm.weight': base['model.norm.weight'] + sign * d}, config,
            shard_bytes=10**9)
  hf.save(str(tmp_path / 'base'), base, config, shard_bytes=10**9)
  out = str(tmp_path / 'out')
  with pytest.raises(UserError, match='multislerp: the weighted mean of the directions of '
                     'model.norm.weight is zero'):
    checkpoints.merge(str(tmp_path / 'base'), paths, out,
                      checkpoints.Plan('multislerp', {}, weights=(1.0, 2.0, 1.0)))
  assert not os.path.exists(out) and not os.path.exists(out + '.partial')


def ranked_by_blocks(monkeypatch) -> list:
  """Blocks of 64 entries, and every tensor of 256 or more ranked by passes over its blocks;
  returns the list of how many chunks each select's passes read."""
  monkeypatch.setattr(pipeline, 'BLOCK', 64)
  monkeypatch.setattr(ranking, 'HELD', 255)
  chunks = []
  original = cuts.select
  monkeypatch.setattr(cuts, 'select', lambda passes, *args: chunks.append(
      sum(1 for _ in passes())) or original(passes, *args))
  return chunks


@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('name', ['ties', 'ties_per_model', 'breadcrumbs', 'sce',
                                  'arcee_fusion'])
def test_tensors_ranked_a_block_at_a_time_equal_the_in_memory_merge(tmp_path, monkeypatch,
                                                                    name, dtype):
  """Every tensor of 256 entries or more ranked by a select whose passes read it a block at a
  time: the same masks (SCE's of its variances, within its energies' rounding; Arcee
  Fusion's of its importances, its quartiles selected so)."""
  chunks = ranked_by_blocks(monkeypatch)
  base, models = fixture(str(tmp_path), dtype, shard_bytes=3000)
  models = fixed_count(name, models)
  out = str(tmp_path / 'out')
  checkpoints.merge(base, models, out, PLANS[name])
  streamed = reference.read_output(out)
  for n, x in reference.in_memory(base, models, PLANS[name]).items():
    assert_merged_equal(name, streamed[n], x, n)
  assert any(n > 1 for n in chunks), 'no tensor was ranked a block at a time'


def test_arcee_fusion_computes_each_rows_divergence_once_over_its_passes(tmp_path, monkeypatch):
  """Ranked by passes, a tensor's scores are read three times or more (sample, select, merge),
  but the two softmaxes of a row, the costly part of its scores, once: in the first pass."""
  ranked_by_blocks(monkeypatch)
  base, models = fixture(str(tmp_path), np.float32, shard_bytes=3000)
  rows = []
  divergence = arcee_fusion.divergence
  monkeypatch.setattr(arcee_fusion, 'divergence',
                      lambda tuned, base_rows: rows.append(len(tuned)) or divergence(tuned,
                                                                                     base_rows))
  checkpoints.merge(base, models[:1], str(tmp_path / 'out'), PLANS['arcee_fusion'])
  # A (outputs, inputs) matrix's rows; a vector is one row.
  assert sum(rows) == sum(x.shape[0] if x.ndim == 2 else 1
                          for x in llama_tensors(0, np.float32).values())


def test_a_count_keeping_none_or_all_reads_no_magnitude(tmp_path, monkeypatch):
  """Breadcrumbs dropping none of the smallest ranks only its top count; TIES keeping
  everything ranks nothing: the same bits as the in-memory merge either way."""
  chunks = ranked_by_blocks(monkeypatch)
  base, models = fixture(str(tmp_path), np.float32, shard_bytes=3000)
  breadcrumbs = checkpoints.Plan('breadcrumbs', {'top': 0.05, 'bottom': 0.0})
  checkpoints.merge(base, models, str(tmp_path / 'breadcrumbs'), breadcrumbs)
  streamed = reference.read_output(str(tmp_path / 'breadcrumbs'))
  for n, x in reference.in_memory(base, models, breadcrumbs).items():
    np.testing.assert_array_equal(bits(streamed[n]), bits(x), err_msg=n)
  assert any(n > 1 for n in chunks), 'no tensor was ranked a block at a time'

  def unread(*args):
    raise AssertionError('magnitudes read for a count that keeps every entry')

  monkeypatch.setattr(ranking.TensorRanking, 'magnitudes', unread)
  everything = checkpoints.Plan('ties', {'density': 1.0, 'scope': 'tensor'})
  checkpoints.merge(base, models, str(tmp_path / 'ties'), everything)
  streamed = reference.read_output(str(tmp_path / 'ties'))
  for n, x in reference.in_memory(base, models, everything).items():
    np.testing.assert_array_equal(bits(streamed[n]), bits(x), err_msg=n)


def test_task_arithmetic_and_ties_follow_mergekits_conventions(tmp_path):
  base, models = fixture(str(tmp_path))
  theta0 = reference.read_output(base)
  thetas = [reference.read_output(m) for m in models]
  checkpoints.merge(base, models, str(tmp_path / 'ta'), PLANS['task_arithmetic'])
  ta = reference.read_output(str(tmp_path / 'ta'))
  checkpoints.merge(base, models, str(tmp_path / 'ties'), PLANS['ties'])
  ties = reference.read_output(str(tmp_path / 'ties'))
  for n, x0 in theta0.items():
    deltas = np.stack([t[n] - x0 for t in thetas]).reshape(3, -1).astype(np.float64)
    np.testing.assert_allclose(ta[n], x0 + 0.7 * deltas.sum(0).reshape(x0.shape), rtol=1e-5,
                               atol=1e-6)
    count = max(1, int(0.2 * deltas.shape[1]))  # mergekit's kept count, per tensor
    trimmed = np.zeros_like(deltas)
    for t in range(3):
      keep = np.argsort(-np.abs(deltas[t]), kind='stable')[:count]
      trimmed[t, keep] = deltas[t, keep]
    sign = np.where(trimmed.sum(0) >= 0, 1.0, -1.0)  # a zero sum elects +
    agree = (np.sign(trimmed) == sign) & (trimmed != 0)
    mean = (trimmed * agree).sum(0) / np.maximum(agree.sum(0), 1)  # agreeing non-zero entries
    np.testing.assert_allclose(ties[n], x0 + 0.9 * mean.reshape(x0.shape), rtol=1e-5,
                               atol=1e-6)


def output_bytes(directory):
  return {f: hashlib.sha256(open(os.path.join(directory, f), 'rb').read()).hexdigest()
          for f in sorted(os.listdir(directory))}


def test_a_crashed_merge_resumes_to_the_same_bytes(tmp_path, monkeypatch):
  base, models = fixture(str(tmp_path))
  plan = checkpoints.Plan('dare', PLANS['dare'].settings, seed=3, shard_bytes=2500)
  checkpoints.merge(base, models, str(tmp_path / 'whole'), plan)
  calls = {'n': 0}
  original = tensors.TensorMerge.block

  def crash_midway(*args):
    calls['n'] += 1
    if calls['n'] == 12:
      raise KeyboardInterrupt('killed')
    return original(*args)

  monkeypatch.setattr(tensors.TensorMerge, 'block', crash_midway)
  out = str(tmp_path / 'resumed')
  with pytest.raises(KeyboardInterrupt):
    checkpoints.merge(base, models, out, plan)
  assert not os.path.exists(out)
  finished = [f for f in os.listdir(out + '.partial') if f.endswith('.safetensors')]
  assert finished, 'no shard finished before the crash'
  monkeypatch.setattr(tensors.TensorMerge, 'block', original)
  checkpoints.merge(base, models, out, plan)
  assert output_bytes(out) == output_bytes(str(tmp_path / 'whole'))
  assert len([f for f in os.listdir(out) if f.startswith('model-')]) > 1


def rewrite(directory, change):
  ckpt = hf.Checkpoint(directory)
  tensors = {n: ckpt.tensor(n) for n in ckpt.files}
  change(tensors)
  hf.save(directory, tensors, ckpt.config, shard_bytes=10**9)


def nan_in(tensors):
  tensors['model.norm.weight'] = tensors['model.norm.weight'].copy()
  tensors['model.norm.weight'][3] = np.nan


def drop_second_shard(directory):
  ckpt = hf.Checkpoint(directory)
  hf.save(directory, {n: ckpt.tensor(n) for n in ckpt.files}, ckpt.config, shard_bytes=3000)
  os.remove(os.path.join(directory, sorted(f for f in os.listdir(directory)
                                           if f.startswith('model-'))[1]))


BAD = {
    'missing key': (lambda d: rewrite(d, lambda t: t.pop('lm_head.weight')),
                    r'ft1 does not have the tensors of .*missing \[.lm_head.weight.\]'),
    'extra key': (lambda d: rewrite(d, lambda t: t.update(extra=np.zeros(2, np.float32))),
                  r"ft1 does not have the tensors .*extra \['extra'\]"),
    'shape': (lambda d: rewrite(d, lambda t: t.update({'model.norm.weight': np.zeros(
        (HIDDEN + 1,), np.float32)})), r'ft1: model.norm.weight is float32\[17\], the base '),
    'dtype': (lambda d: rewrite(d, lambda t: t.update({'model.norm.weight': np.zeros(
        (HIDDEN,), np.float16)})), r'ft1: model.norm.weight is float16\[16\]'),
    'nan': (lambda d: rewrite(d, nan_in), r'ft1: model.norm.weight holds non-finite'),
    'truncated': (lambda d: open(os.path.join(d, hf.SINGLE), 'r+b').truncate(500),
                  r'ft1/model.safetensors is not a readable safetensors file'),
    'pickle': (lambda d: (os.remove(os.path.join(d, hf.SINGLE)),
                          open(os.path.join(d, 'pytorch_model.bin'), 'wb').write(b'\x80\x04')),
               r'only pickled weights \(pytorch_model.bin\)'),
    'missing shard': (lambda d: drop_second_shard(d), r"names shard\(s\) \['model-00002-of-"),
}


@pytest.mark.parametrize('case', sorted(BAD))
def test_bad_inputs_are_named_and_nothing_is_written(tmp_path, case):
  base, models = fixture(str(tmp_path))
  corrupt, message = BAD[case]
  corrupt(models[1])
  out = str(tmp_path / 'out')
  with pytest.raises(UserError, match=message):
    checkpoints.merge(base, models, out, PLANS['ties'])
  assert not os.path.exists(out)


@pytest.mark.parametrize('method, settings', [('ties', {'scope': 'tensor'}), ('breadcrumbs', {}),
                                               ('ties', {'scope': 'global'})])
def test_ranking_methods_refuse_to_allow_nonfinite_inputs(method, settings):
  with pytest.raises(UserError, match=f'{method} ranks magnitudes, and a NaN has no rank'):
    checkpoints.Plan(method, settings, allow_nonfinite=True)


def test_methods_that_need_data_are_refused():
  with pytest.raises(UserError, match="'fisher' reads data"):
    checkpoints.Plan('fisher', {})
  with pytest.raises(UserError, match='is not a checkpoint merge'):
    checkpoints.Plan('tie', {})


def test_nan_inputs_merge_when_allowed(tmp_path):
  base, models = fixture(str(tmp_path))
  rewrite(models[0], nan_in)
  plan = checkpoints.Plan('task_arithmetic', {}, allow_nonfinite=True)
  checkpoints.merge(base, models, str(tmp_path / 'out'), plan)
  assert np.isnan(reference.read_output(str(tmp_path / 'out'))['model.norm.weight'][3])
  assert json.load(open(tmp_path / 'out' / 'config.json'))['model_type'] == 'llama'


@pytest.mark.parametrize('method', ['task_arithmetic', 'ties'])
def test_float64_tensors_are_written_in_float64(tmp_path, method):
  # JAX computes them in float32 (x64 is off); the output keeps the dtype as stored.
  base, models = fixture(str(tmp_path))
  for directory in [base] + models:
    rewrite(directory, lambda t: t.update({'model.norm.weight': t['model.norm.weight'].astype(
        np.float64)}))
  plan = checkpoints.Plan(method, {'density': 0.5} if method == 'ties' else {}, scale=0.3)
  checkpoints.merge(base, models, str(tmp_path / 'out'), plan)
  streamed = reference.read_output(str(tmp_path / 'out'))['model.norm.weight']
  expected = reference.in_memory(base, models, plan)['model.norm.weight']
  assert streamed.dtype == expected.dtype == np.float64
  np.testing.assert_array_equal(bits(streamed), bits(expected))


def test_the_launch_job_merges_and_names_a_data_method_in_one_line(tmp_path, run_python):
  base, models = fixture(str(tmp_path))
  args = ['-m', 'launch.merge_checkpoints', f'--workdir={tmp_path}', f'--config.base={base}',
          f'--config.models={",".join(models)}', '--config.method=ties']
  run_python(args)
  assert set(reference.read_output(str(tmp_path / 'merged'))) == set(
      reference.read_output(base))
  proc = run_python(args[:-1] + ['--config.method=fisher'], check=False)
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith("error: config.method = 'fisher' reads data")


def test_a_global_ranking_with_ties_across_tensors_equals_the_in_memory_one(tmp_path):
  """Deltas on a coarse grid: the kept-th largest magnitude is shared by many entries in
  several tensors, so which of them are kept is decided by tensor order then row-major."""
  rng = np.random.default_rng(5)
  base = llama_tensors(0)
  config = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}
  hf.save(str(tmp_path / 'base'), base, config, shard_bytes=4000)
  models = []
  for k in range(2):
    tuned = {n: x + rng.integers(-2, 3, x.shape).astype(np.float32) / 4 for n, x in base.items()}
    models.append(str(tmp_path / f'ft{k}'))
    hf.save(models[-1], tuned, config, shard_bytes=4000)
  for density in (0.1, 0.37, 0.8):
    plan = checkpoints.Plan('ties', {'density': density, 'scope': 'global'}, shard_bytes=3000)
    out = str(tmp_path / f'out{density}')
    checkpoints.merge(str(tmp_path / 'base'), models, out, plan)
    streamed = reference.read_output(out)
    for n, x in reference.in_memory(str(tmp_path / 'base'), models, plan).items():
      np.testing.assert_array_equal(bits(streamed[n]), bits(x), err_msg=f'{density} {n}')


@pytest.mark.parametrize('method, settings', [('ties', {'density': 0.2, 'scope': 'tensor'}),
                                              ('tsv_m', {})])
def test_lines_is_a_scale_gradient_over_the_layers(tmp_path, method, settings):
  """LiNeS over any streamed merge, as a recipe gives it: λ from α at the first layer (and
  outside the layers) to α + β at the last, which is the suite's LiNeS (merging/lines.py)."""
  alpha, beta = 0.25, 0.5
  base, models = fixture(str(tmp_path))
  out = str(tmp_path / 'out')
  checkpoints.merge(base, models, out, checkpoints.Plan(
      method, settings, layered=(('scale', [alpha, alpha + beta]),)))
  streamed = reference.read_output(out)
  floats = {n: np.asarray(x, np.float32) for n, x in llama_tensors(0).items()}
  vectors = tensors.task_vectors(
      floats, [{n: hf.Checkpoint(m).tensor(n) for n in floats} for m in models],
      [f'model_{i}' for i in range(len(models))])
  plain = merging.get(method).merge(vectors, **checkpoints.Plan(method, settings).settings)
  scaled = lines.scale(plain, alpha, beta).delta
  for n, x in floats.items():
    depth = alpha + beta if f'.{LAYERS - 1}.' in n else alpha
    np.testing.assert_allclose(scaled[n], depth * np.asarray(plain.delta[n]), rtol=1e-6,
                               err_msg=n)
    np.testing.assert_allclose(streamed[n], x + np.asarray(scaled[n]), rtol=1e-6, atol=1e-6,
                               err_msg=n)


# One plan of each way the engine reads and places a tensor: a block at a time, ranked over
# all tensors, drawn and ranked, rescaled by L1 norms, ranked at both ends, and whole (by SVD,
# by angles, by norms, by per-row ranks). Each method's own code on split arrays is
# tests/test_sharding.py's.
SPLIT = ('task_arithmetic', 'ties_global', 'dare_global', 'dare_l1_global', 'breadcrumbs',
         'tsv_m', 'model_stock', 'slerp', 'della')
SPLIT_MERGES = r'''
import sys
import jax
from merging import checkpoints
from tests.test_checkpoint_merging import PLANS, SPLIT, fixed_count
base, root = sys.argv[1:3]
models = [f'{root}/ft{k}' for k in range(3)]
assert len(jax.devices()) == 8
for name in SPLIT:
  checkpoints.merge(base, fixed_count(name, models), f'{root}/eight/{name}', PLANS[name])
'''


def test_merges_split_over_eight_devices_write_the_bytes_of_one(tmp_path, run_python):
  """Each tensor split over 8 simulated devices where a dimension allows (the Llama fixture's
  16-, 32- and 8-row tensors), against one device: the same files."""
  base, models = fixture(str(tmp_path), shard_bytes=3000)
  run_python(['-c', SPLIT_MERGES, base, str(tmp_path)],
             env={'XLA_FLAGS': xla_flags(devices=8)})
  for name in SPLIT:
    checkpoints.merge(base, fixed_count(name, models), str(tmp_path / 'one' / name), PLANS[name])
    assert output_bytes(tmp_path / 'eight' / name) == output_bytes(tmp_path / 'one' / name), name


@pytest.mark.parametrize('name', ['dare_linear', 'dare_ties_l1', 'della', 'della_l1'])
def test_draws_without_a_ranking_merge_a_block_at_a_time(tmp_path, monkeypatch, name):
  """No tensor held whole (blocks of 48 entries, which divide no tensor; DELLA's of whole rows
  of 16 or 32, the most that fit), and a block's draws are its entries' own: the in-memory
  merge's."""
  monkeypatch.setattr(pipeline, 'BLOCK', 48)
  monkeypatch.setattr(tensors.TensorMerge, '_merge_whole',
                      lambda *args: pytest.fail('a tensor was merged whole'))
  base, models = fixture(str(tmp_path), np.float32, shard_bytes=3000)
  checkpoints.merge(base, models, str(tmp_path / 'out'), PLANS[name])
  streamed = reference.read_output(str(tmp_path / 'out'))
  for n, x in reference.in_memory(base, models, PLANS[name]).items():
    assert_merged_equal(name, streamed[n], x, n)


def test_a_leafs_draws_are_its_entries_whoever_draws_them():
  """DARE's keep mask of any run of a leaf's entries is that run of the leaf's mask drawn
  whole, each entry kept with probability q, independently of its neighbours."""
  key = jax.random.PRNGKey(7)
  whole = np.asarray(ops.kept_entries(key, 0.3, 0, 1000))
  for start, size in ((0, 64), (192, 128), (37, 400), (999, 1)):
    np.testing.assert_array_equal(np.asarray(ops.kept_entries(key, 0.3, start, size)),
                                  whole[start:start + size])
  many = np.asarray(ops.kept_entries(key, 0.3, 0, 200_000))
  assert abs(many.mean() - 0.3) < 5 * np.sqrt(0.3 * 0.7 / many.size)
  both = (many[1:] & many[:-1]).mean()  # neighbours kept together as often as independence says
  assert abs(both - 0.09) < 5 * np.sqrt(0.09 * 0.91 / many.size)
  assert not np.array_equal(whole, np.asarray(ops.kept_entries(jax.random.PRNGKey(8), 0.3, 0,
                                                                1000)))
