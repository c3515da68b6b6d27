"""Continual merging: task vectors arrive one at a time, and only the running merge is kept.

A continual method is a `Running` pair of pure functions, `start(τ_1)` and `step(state, τ_t)`,
and `vector(state)` is the model's task vector after any step, applied as θ0 + vector. The
state never holds an earlier task's vector: it is the running merge and a few scalars.

  task_arithmetic  K ← K + λ·τ_t, λ = 0.3 (FusionBench's continual baseline); vector K
  weight_average   K ← ((t − 1)·K + τ_t) / t; vector K
  ties             K ← TIES(K, τ_t): each trimmed to its top `density`, signs elected, the
                   agreeing entries averaged (merging/ties.py); vector λ·K, λ = 0.5
  magmax           K[j] ← τ_t[j] where |τ_t[j]| ≥ |K[j]| (MagMax, merging/magmax.py, run as
                   it arrives); vector λ·K, λ = 0.5. With independent fine-tunes this is MagMax
                   of all the vectors seen.
  opcm             Tang et al., "Merging Models on the Fly Without Retraining: A Sequential
                   Approach to Scalable Continual Model Merging", NeurIPS 2025 (below)

OPCM keeps Δ, the merge normalised to the mean norm n̄_t of the task vectors seen, and λ_t with
λ_t·Δ_t the unnormalised sum. Starting from Δ_1 = τ_1, λ_1 = 1, for every linear weight (a
kernel, as the matrix every SVD-era merge reads: `ops.matrices`) with the full SVD
Δ_{t−1} = U S Vᵀ:

  P = Uᵀ τ_t V,   P_ii = 0,   P[:r, :r] = 0,   r = the first i with Σ_{j≤i} S_j / Σ S > α,
  τ̃_t = U P Vᵀ,   S_t = λ_{t−1}·Δ_{t−1} + τ̃_t

and S_t = λ_{t−1}·Δ_{t−1} + τ_t for every other leaf (biases, norms, embeddings). Then
λ_t = ‖S_t‖ / n̄_t and Δ_t = S_t / λ_t over the whole model; vector Δ_t. So τ_t enters only in
the directions the merge does not already span (outside its top singular directions and its
own singular pairs), and the merge keeps the size of one task vector. α = 0.5, the authors'
default. As in their code, the SVD is of the stored Δ_{t−1}, the split index r counts from 0,
and only the linear weights are projected.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from editing import settings
from editing import tree as tree_lib
from editing.task_vector import TaskVector, check_compatible
from merging import magmax
from merging import ops
from merging import svd
from merging import ties

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Running:
  """A continual method: state = start(τ_1, **settings), state = step(state, τ_t, **settings)
  for each later vector, and the model after any step θ0 + vector(state, **settings)."""

  start: Callable
  step: Callable
  vector: Callable


def _sum_start(first: TaskVector, *, scale: float) -> dict:
  return {'merged': first * scale}


def _sum_step(state: dict, arriving: TaskVector, *, scale: float) -> dict:
  return {'merged': state['merged'] + arriving * scale}


def _average_start(first: TaskVector) -> dict:
  return {'merged': first, 'count': 1}


def _average_step(state: dict, arriving: TaskVector) -> dict:
  count = state['count'] + 1
  return {'merged': state['merged'] * ((count - 1) / count) + arriving * (1 / count),
          'count': count}


def _kept_start(first: TaskVector, **_) -> dict:
  return {'merged': first}


def _ties_step(state: dict, arriving: TaskVector, *, density: float, scale: float) -> dict:
  del scale
  return {'merged': ties.merge([state['merged'], arriving], density=density, scope='global',
                               normalize=True)}


def _magmax_step(state: dict, arriving: TaskVector, *, scale: float) -> dict:
  del scale
  return {'merged': magmax.merge([state['merged'], arriving])}


def _scaled_vector(state: dict, *, scale: float, **_) -> TaskVector:
  return state['merged'] * scale


def _plain_vector(state: dict, **_) -> TaskVector:
  return state['merged']


def _norm(vector: TaskVector) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(vector.delta)))


def _opcm_start(first: TaskVector, *, alpha: float) -> dict:
  del alpha
  return {'merged': first, 'lambda': 1.0, 'norms': [float(_norm(first))]}


def project_out(merged: jax.Array, arriving: jax.Array, alpha: float) -> jax.Array:
  """τ̃ = U P Vᵀ, P = Uᵀ τ V less its diagonal and its top-left r × r block, for one matrix."""
  u, s, vt = svd.complete(merged)
  share = jnp.cumsum(s) / jnp.sum(s)
  split = jnp.argmax(share > alpha)
  p = u.T @ arriving @ vt.T
  rows, cols = jnp.arange(p.shape[0])[:, None], jnp.arange(p.shape[1])[None, :]
  p = jnp.where((rows == cols) | ((rows < split) & (cols < split)), 0.0, p)
  return u @ p @ vt


def _opcm_step(state: dict, arriving: TaskVector, *, alpha: float) -> dict:
  merged, lam = state['merged'], state['lambda']
  arrivals = tree_lib.flatten(arriving.delta)
  views = ops.matrices(merged.delta)

  def combine(path, kept):
    new, view = arrivals[path], views[path]
    # Kernels only: the authors project nn.Linear weights, not embeddings.
    if view is not None and view.transposed:
      new = view.back(project_out(view.of(kept), view.of(new), alpha), new.shape)
    return lam * kept + new

  summed = tree_lib.map_with_path(combine, merged.delta)
  norms = state['norms'] + [float(_norm(arriving))]
  mean_norm = sum(norms) / len(norms)
  total = TaskVector(summed, merged.tasks + arriving.tasks, merged.regime, merged.base)
  new_lambda = float(_norm(total)) / mean_norm
  return {'merged': total * (1 / new_lambda), 'lambda': new_lambda, 'norms': norms}


_SCALE = settings.number(0.5, '[0, inf)', 'λ of the running merge\'s vector')

METHODS = {
    'task_arithmetic': (Running(_sum_start, _sum_step, _plain_vector),
                        dict(scale=settings.number(0.3, '[0, inf)', 'λ of each arriving '
                                                                    'vector'))),
    'weight_average': (Running(_average_start, _average_step, _plain_vector), {}),
    'ties': (Running(_kept_start, _ties_step, _scaled_vector),
             dict(density=settings.number(0.2, '(0, 1]', 'the share of each vector\'s entries '
                                                        'kept by magnitude'), scale=_SCALE)),
    'magmax': (Running(_kept_start, _magmax_step, _scaled_vector), dict(scale=_SCALE)),
    'opcm': (Running(_opcm_start, _opcm_step, _plain_vector),
             dict(alpha=settings.number(0.5, '[0, 1]', 'the share of the merge\'s singular '
                                                       'values whose directions τ stays out '
                                                       'of'))),
}


def run(name: str, vectors: list[TaskVector], values: dict) -> list[TaskVector]:
  """The model's task vector after each arrival of `vectors`, in order, by method `name`
  (whose settings `values` are, checked)."""
  check_compatible(vectors, name)
  running, _ = METHODS[name]
  state = running.start(vectors[0], **values)
  out = [running.vector(state, **values)]
  for arriving in vectors[1:]:
    state = running.step(state, arriving, **values)
    out.append(running.vector(state, **values))
  return out
