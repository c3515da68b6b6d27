"""The SVD-era merges (TSV-M, Iso-C, Iso-CTS, WUDI), Model Stock, MagMax and LiNeS: each against
a plain numpy reference with the reference implementation's conventions, and its defining
property."""

import jax
import numpy as np
import pytest

import merging
from editing.task_vector import TaskVector
from merging import iso_c
from merging import iso_cts
from merging import lines
from merging import ops
from merging import tsv_m
from merging import wudi

RNG = np.random.default_rng(0)
SHAPES = {'blocks_0/mlp_fc/kernel': (6, 10), 'blocks_0/mlp_fc/bias': (10,),
          'blocks_1/attn/query/kernel': (8, 2, 4), 'blocks_1/attn/query/bias': (2, 4),
          'blocks_1/attn/out/kernel': (2, 4, 8), 'blocks_1/attn/out/bias': (8,),
          'position_embedding': (5, 8), 'patch_embed/kernel': (2, 2, 3, 8)}


def vectors(count=3, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for t in range(count):
    flat = {p: rng.normal(size=s).astype(np.float32) for p, s in SHAPES.items()}
    out.append(TaskVector(_unflat(flat), (f'task{t}',), 'full', 'base'))
  return out


def _unflat(flat):
  from editing import tree  # pylint: disable=g-import-not-at-top
  return tree.unflatten(flat)


def flat(vector):
  from editing import tree  # pylint: disable=g-import-not-at-top
  return {p: np.asarray(x) for p, x in tree.flatten(vector.delta).items()}


def numpy_matrix(path, x):
  """The (outputs, inputs) matrix of a leaf as FusionBench's PyTorch tensors hold it, or None."""
  if path.endswith('query/kernel'):
    return x.reshape(8, 8).T
  if path.endswith('out/kernel'):
    return x.reshape(8, 8).T
  if path.endswith('mlp_fc/kernel'):
    return x.T
  if path == 'position_embedding':
    return x
  return None


def numpy_merge(vs, merge_matrix):
  """A per-matrix merge in numpy, every other leaf averaged; back in our layout."""
  deltas = [flat(v) for v in vs]
  out = {}
  for path, x in deltas[0].items():
    ms = [numpy_matrix(path, d[path]) for d in deltas]
    if ms[0] is None:
      out[path] = np.mean([d[path] for d in deltas], axis=0)
    else:
      merged = merge_matrix([m.astype(np.float64) for m in ms])
      out[path] = (merged if path == 'position_embedding' else merged.T).reshape(x.shape)
  return out


def polar(a):
  p, _, qt = np.linalg.svd(a, full_matrices=False)
  return p @ qt


def tsv_reference(ms):
  k = min(ms[0].shape) // len(ms)
  svds = [np.linalg.svd(m, full_matrices=False) for m in ms]
  u = np.concatenate([u[:, :k] for u, _, _ in svds], 1)
  s = np.concatenate([s[:k] for _, s, _ in svds])
  vt = np.concatenate([vt[:k] for _, _, vt in svds], 0)
  return polar(u) @ np.diag(s) @ polar(vt)


def iso_c_reference(ms):
  u, s, vt = np.linalg.svd(sum(ms), full_matrices=False)
  return s.mean() * u @ vt


def iso_cts_reference(ms, fraction=0.8):
  r, t = min(ms[0].shape), len(ms)
  k = int(r * fraction)
  total = round((r - k) / t) * t
  k, s = r - total, total // t
  u, sig, vt = np.linalg.svd(sum(ms), full_matrices=False)
  uc, sc, vtc = u[:, :k], sig[:k], vt[:k]
  blocks = [np.linalg.svd(m - uc @ uc.T @ m, full_matrices=False) for m in ms]
  uu = polar(np.concatenate([b[0][:, :s] for b in blocks] + [uc], 1))
  vv = polar(np.concatenate([b[2][:s] for b in blocks] + [vtc], 0))
  return np.concatenate([b[1][:s] for b in blocks] + [sc]).mean() * uu @ vv


@pytest.mark.parametrize('name, reference', [
    ('tsv_m', tsv_reference), ('iso_c', iso_c_reference), ('iso_cts', iso_cts_reference)])
def test_svd_merges_equal_a_numpy_reference(name, reference):
  vs = vectors()
  merged = flat(merging.get(name).merge(vs))
  for path, expected in numpy_merge(vs, reference).items():
    np.testing.assert_allclose(merged[path], expected, rtol=2e-4, atol=2e-5, err_msg=path)


def singular_values(path, x):
  return np.linalg.svd(numpy_matrix(path, x), compute_uv=False)


MATRIX_MERGES = {
    'tsv_m': lambda ms: tsv_m.merge_matrix(ms, 'full'),
    'iso_c': iso_c.merge_matrix,
    'iso_cts': lambda ms: iso_cts.merge_matrix(ms, 0.8, 'full'),
    'wudi': lambda ms: wudi.solve(np.stack(ms), steps=5, learning_rate=1e-5)}


@pytest.mark.parametrize('name', list(MATRIX_MERGES))
def test_a_layer_no_task_changed_merges_to_zero_without_its_svds(name, monkeypatch):
  """Each method's Δ of zero matrices is zero (σ = 0 scales every direction it keeps; WUDI's
  gradient at 0 is 0), so per_matrix skips such a layer: the SVD never sees its shape."""
  assert not np.any(np.asarray(MATRIX_MERGES[name]([np.zeros((10, 6), np.float32)] * 3)))
  zero = 'blocks_0/mlp_fc/kernel'
  tasks = vectors()
  for v in tasks:
    v.delta['blocks_0']['mlp_fc']['kernel'] = np.zeros(SHAPES[zero], np.float32)
  given = {'steps': 5} if name == 'wudi' else {}
  seen = []
  thin = merging.svd.thin
  monkeypatch.setattr(merging.svd, 'thin', lambda m: seen.append(m.shape) or thin(m))
  merged = flat(merging.get(name).merge(tasks, **given))
  assert not np.any(merged[zero]) and merged[zero].shape == SHAPES[zero]
  assert (10, 6) not in seen and (name == 'wudi' or seen)


def test_iso_c_flattens_every_layer_spectrum_to_the_mean_of_the_sum():
  vs = vectors()
  merged = flat(merging.get('iso_c').merge(vs))
  total = {p: sum(flat(v)[p] for v in vs) for p in SHAPES}
  for path in ('blocks_0/mlp_fc/kernel', 'blocks_1/attn/query/kernel', 'position_embedding'):
    spectrum = singular_values(path, merged[path])
    np.testing.assert_allclose(spectrum, singular_values(path, total[path]).mean(), rtol=1e-4)


def test_tsv_m_keeps_each_task_in_orthogonal_directions():
  """The merged layer's spectrum is the tasks' top-k singular values, and each task's kept
  directions are mutually orthogonal to the others' after the whitening."""
  vs = vectors(count=2, seed=3)
  path = 'blocks_0/mlp_fc/kernel'
  merged = numpy_matrix(path, flat(merging.get('tsv_m').merge(vs))[path])
  k = 6 // 2
  kept = np.concatenate([np.linalg.svd(numpy_matrix(path, flat(v)[path]),
                                       compute_uv=False)[:k] for v in vs])
  np.testing.assert_allclose(np.sort(np.linalg.svd(merged, compute_uv=False))[::-1][:2 * k],
                             np.sort(kept)[::-1], rtol=1e-4)
  u, _, _ = np.linalg.svd(merged, full_matrices=False)
  np.testing.assert_allclose(u.T @ u, np.eye(u.shape[1]), atol=1e-5)


def test_iso_cts_sizes_its_subspaces_with_pythons_round():
  assert iso_cts.subspace_sizes(50, 4, 0.8) == (42, 2)  # round(2.5) is 2, half to even
  assert iso_cts.subspace_sizes(768, 8, 0.8) == (616, 19)  # int(614.4), round(19.25)
  assert sum(iso_cts.subspace_sizes(64, 3, 0.8)) <= 64


def test_magmax_keeps_the_largest_magnitude_per_entry_ties_to_the_later_task():
  a = TaskVector({'w': np.array([1.0, -3.0, 2.0, 0.5], np.float32)}, ('a',), 'full', 'b')
  b = TaskVector({'w': np.array([-2.0, 1.0, -2.0, 0.25], np.float32)}, ('b',), 'full', 'b')
  merged = np.asarray(merging.get('magmax').merge([a, b]).delta['w'])
  np.testing.assert_array_equal(merged, [-2.0, -3.0, -2.0, 0.5])
  vs = vectors()
  stacked = np.stack([flat(v)['position_embedding'] for v in vs])
  expected = np.take_along_axis(stacked, np.abs(stacked).argmax(0)[None], 0)[0]
  np.testing.assert_array_equal(flat(merging.get('magmax').merge(vs))['position_embedding'],
                                expected)


@pytest.mark.parametrize('clip', [True, False])
@pytest.mark.parametrize('degrees', [0, 30, 60, 90, 120])
def test_model_stock_ratio_follows_the_angle_between_two_vectors(degrees, clip):
  """Two unit deltas at angle θ: t = 2cosθ/(cosθ + 1), τ_m = t·mean; clipped, 0 from a right
  angle on; as mergekit, negative past it."""
  angle = np.deg2rad(degrees)
  a = TaskVector({'w': np.array([1.0, 0.0], np.float32)}, ('a',), 'full', 'b')
  b = TaskVector({'w': np.array([np.cos(angle), np.sin(angle)], np.float32)}, ('b',), 'full',
                 'b')
  cos = max(np.cos(angle), 0.0) if clip else np.cos(angle)
  t = 2 * cos / (cos + 1)
  np.testing.assert_allclose(merging.get('model_stock').merge([a, b], clip=clip).delta['w'],
                             t * (np.array([1.0, 0.0]) + np.array([np.cos(angle),
                                                                   np.sin(angle)])) / 2,
                             atol=1e-6)


def test_model_stock_averages_pairwise_cosines_as_mergekit():
  vs = vectors(count=3, seed=5)
  merged = flat(merging.get('model_stock').merge(vs))
  deltas = [flat(v)['position_embedding'].ravel() for v in vs]
  cosines = [deltas[i] @ deltas[j] / np.linalg.norm(deltas[i]) / np.linalg.norm(deltas[j])
             for i in range(3) for j in range(i + 1, 3)]
  c = np.clip(np.mean(cosines), 0, 1)
  np.testing.assert_allclose(merged['position_embedding'],
                             3 * c / (2 * c + 1) * np.mean(deltas, 0).reshape(5, 8), atol=1e-6)


def test_wudi_lowers_the_interference_it_starts_from_and_follows_adam():
  vs = vectors(count=3, seed=7)
  path = 'blocks_0/mlp_fc/kernel'
  ms = np.stack([numpy_matrix(path, flat(v)[path]) for v in vs])
  start = ms.sum(0)

  def loss(m):
    return sum(np.sum(((m - t) @ t.T) ** 2) / np.sum(t ** 2) for t in ms)

  solved = np.asarray(wudi.solve(ms, steps=50, learning_rate=1e-2))
  assert loss(solved) < 0.8 * loss(start)
  # Adam's first step moves every entry by the learning rate against its gradient's sign.
  grad = sum(2 * ((start - t) @ t.T) @ t / np.sum(t ** 2) for t in ms)
  one = np.asarray(wudi.solve(ms, steps=1, learning_rate=1e-3))
  np.testing.assert_allclose(one, start - 1e-3 * np.sign(grad), atol=1e-6)
  merged = flat(merging.get('wudi').merge(vs, steps=0))
  np.testing.assert_allclose(merged[path], sum(flat(v)[path] for v in vs), rtol=1e-6)
  np.testing.assert_allclose(merged['blocks_0/mlp_fc/bias'],
                             np.mean([flat(v)['blocks_0/mlp_fc/bias'] for v in vs], 0), rtol=1e-6)


@pytest.mark.parametrize('shape', [(3, 12, 5), (3, 5, 12), (3, 2, 20)],
                         ids=['tall', 'wide', 'much_wider'])
def test_wudis_closed_form_gradient_is_its_interferences_which_is_the_papers(shape):
  """The interference against numpy's, and its gradient, through A and B (tall, wide) or task by
  task (inputs > 2T·outputs), against numpy's 2 Σ_t (τ − τ_t) τ_tᵀ τ_t / ‖τ_t‖² and autodiff's."""
  rng = np.random.default_rng(3)
  ms, merged = rng.standard_normal(shape), rng.standard_normal(shape[1:])
  ms[1] = 0  # a zero τ_t adds nothing
  live = ms[[0, 2]]
  direct = sum(np.sum(((merged - t) @ t.T) ** 2) / np.sum(t ** 2) for t in live)
  expected = sum(2 * ((merged - t) @ t.T) @ t / np.sum(t ** 2) for t in live)
  m32, merged32 = ms.astype(np.float32), merged.astype(np.float32)
  np.testing.assert_allclose(wudi.interference(merged32, m32), direct, rtol=1e-5)
  np.testing.assert_allclose(wudi.gradient(m32)(merged32), expected, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(jax.grad(wudi.interference)(merged32, m32), expected, rtol=1e-4,
                             atol=1e-4)


def test_layers_read_as_matrices_as_pytorch_holds_them():
  views = ops.matrices(vectors()[0].delta)
  assert views['blocks_1/attn/query/kernel'] == ops.Matrix(8, 8, True)
  assert views['blocks_1/attn/out/kernel'] == ops.Matrix(8, 8, True)
  assert views['blocks_0/mlp_fc/kernel'] == ops.Matrix(6, 10, True)
  assert views['position_embedding'] == ops.Matrix(8, 5, False)
  assert views['patch_embed/kernel'] is None and views['blocks_0/mlp_fc/bias'] is None
  assert views['blocks_1/attn/query/bias'] is None


def test_lines_scales_each_block_by_its_depth():
  vector = TaskVector({'blocks_0': {'w': np.ones(2)}, 'blocks_1': {'w': np.ones(2)},
                       'blocks_2': {'w': np.ones(2)}, 'proj': np.ones(2)}, ('a',), 'full', 'b')
  scaled = lines.scale(vector, alpha=0.5, beta=1.0).delta
  assert [float(scaled[f'blocks_{i}']['w'][0]) for i in range(3)] == [0.5, 1.0, 1.5]
  assert float(scaled['proj'][0]) == 0.5
  assert lines.block_of('model.layers.11.self_attn.q_proj.weight') == 11
  assert lines.block_of('vision_model.encoder.layers.3.mlp.fc1.weight') == 3
  assert lines.block_of('model.embed_tokens.weight') is None


def test_lines_alpha_for_task_arithmetic_is_one_over_t():
  vs = vectors()
  assert lines.multi_task_alpha(vs, sum(vs)) == pytest.approx(1 / 3)


def test_lines_results_are_named_apart_and_refuse_an_unscaled_method():
  from configs import merge as merge_config  # pylint: disable=g-import-not-at-top
  from editing.errors import UserError  # pylint: disable=g-import-not-at-top
  from merging.jobs import merge  # pylint: disable=g-import-not-at-top
  config = merge_config.get_config('tiny')
  config.merge.lines = 'task_arithmetic,ties'
  assert merge.lines_methods(config) == ['task_arithmetic', 'ties']
  assert merge.settings_used(config, 'ties+lines') == {
      **merge.settings_used(config, 'ties'), 'lines': True}
  config.merge.lines = 'wudi'
  with pytest.raises(UserError, match='config.merge.lines: unknown scaled method'):
    merge.lines_methods(config)
