"""Evaluation: accuracy, and the task-arithmetic protocols of Ilharco et al. (ICLR 2023).

One `Evaluator` serves every edit: it scores θ = θ0 + α·τ through a regime's encoder, so linear
task vectors are judged on the linearized model and non-linear ones on the model.

- Task addition: θ0 + α·Σ_t τ_t; α on a grid chosen on validation by mean normalized accuracy
  (accuracy / the same regime's single-task fine-tuned accuracy); test accuracy reported there.
- Task negation: θ0 − α·τ_t; α minimises target validation accuracy while the control task keeps
  ≥ `threshold` × the pretrained control accuracy; target and control test accuracy reported.
- Weight disentanglement (Ortiz-Jimenez et al., NeurIPS 2023): on a grid of (α1, α2),
  ξ(α1, α2) = Σ_{t=1,2} E_{x∼D_t} 1[pred_t(x; θ0 + α_t τ_t) ≠ pred_t(x; θ0 + α1 τ1 + α2 τ2)],
  each task judged with its own head; 0 where adding the other vector changes nothing.
"""

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from editing import batching
from editing import distributed
from editing import sharding as sharding_lib
from editing.data.suite import Dataset
from editing.errors import UserError
from editing.models import head as head_lib
from editing.progress import Progress
from editing.regimes.base import Encoder
from editing.task_vector import TaskVector

PyTree = Any


def alpha_grid(step: float = 0.05, stop: float = 1.0) -> list[float]:
  """0, step, ..., stop, rounded so that 0.15 prints as 0.15."""
  return [round(i * step, 10) for i in range(int(round(stop / step)) + 1)]


class Evaluator:
  """Predictions of encoder + frozen cosine head, in fixed-size batches split over the mesh's
  data × fsdp axes (one compile), with θ0, params and task vectors placed by `sharding_rules`
  (the training rules: a model that trains sharded evaluates sharded).

  The encoder is the only compiled program: the datasets scored under one edit are read as one
  sequence of full batches (so eight validation sets of 500 fill batches of 512 instead of
  padding eight), the last batch padded only to the halving of the batch size that holds it,
  and each head classifies its own dataset's features on the host (by cosine: no logit scale,
  which changes no prediction). Heads of any number of classes thus share the encoder's
  compiles.
  """

  def __init__(self, encoder: Encoder, *, mesh: jax.sharding.Mesh, batch_size: int,
               sharding_rules=sharding_lib.REPLICATED_RULES):
    sharding_lib.check_batch_size(mesh, batch_size, 'eval batch_size')
    self.encoder = encoder
    self._batch_size = batch_size
    self._mesh, self._rules = mesh, sharding_rules
    self._batch = sharding_lib.batch_sharding(mesh)
    self._encode = jax.jit(encoder, out_shardings=self._batch)
    self._apply = jax.jit(lambda theta0, vector, alpha: vector.apply_to(theta0, alpha))
    self._apply_sum = jax.jit(lambda theta0, vectors, alphas: sum(
        v * a for v, a in zip(vectors, alphas)).apply_to(theta0))

  def with_encoder(self, encoder: Encoder) -> 'Evaluator':
    """An evaluator of the same mesh, batches and rules, scoring through `encoder`."""
    return Evaluator(encoder, mesh=self._mesh, batch_size=self._batch_size,
                     sharding_rules=self._rules)

  def place(self, params: PyTree) -> PyTree:
    """`params` on the mesh, by the rules (a no-op for params already placed so)."""
    return jax.device_put(params, sharding_lib.param_shardings(self._mesh, params, self._rules))

  def features(self, theta0: PyTree, params: PyTree, data: Dataset) -> np.ndarray:
    return self._features(theta0, params, [data])[0]

  def _features(self, theta0: PyTree, params: PyTree, datasets: Sequence[Dataset]) -> list:
    """The encoder's features of each dataset, from one pass over all of them in order."""
    theta0, params = self.place(theta0), self.place(params)
    chain = _Chain(datasets)
    outputs = []
    # Padding rows repeat row 0 and are cut from the outputs.
    for batch in batching.padded_batches([np.arange(len(chain))], self._batch_size,
                                         multiple=sharding_lib.batch_devices(self._mesh)):
      images, _ = distributed.global_batch(chain.batch, batch.arrays[0], self._batch)
      outputs.append(distributed.to_host(self._encode(theta0, params, images))[:batch.count])
    return np.split(np.concatenate(outputs), np.cumsum([len(d) for d in datasets])[:-1])

  def predict(self, theta0: PyTree, params: PyTree,
              scored: Mapping[Any, tuple[Any, Dataset]]) -> dict[Any, np.ndarray]:
    """{key: predictions} of `scored` = {key: (head, dataset)}, from one feature pass: the
    head's classes, or with no head (a decoder's text) what the dataset reads off the
    encoder's features (`text_finetune.Rows.predictions`)."""
    features = self._features(theta0, params, [data for _, data in scored.values()])
    return {key: data.predictions(f) if head is None else
            np.asarray(jnp.argmax(head_lib.logits(f, head, 1.0), axis=-1))
            for (key, (head, data)), f in zip(scored.items(), features)}

  def accuracies(self, theta0: PyTree, params: PyTree,
                 scored: Mapping[Any, tuple[Any, Dataset]]) -> dict[Any, float]:
    """{key: accuracy} of `scored` = {key: (head, dataset)}, from one feature pass: what
    each dataset scores its predictions by (classes: accuracy; text: exact match, or the
    likelihood of held-out text)."""
    predicted = self.predict(theta0, params, scored)
    return {key: data.score(predicted[key]) for key, (_, data) in scored.items()}

  def predictions(self, theta0: PyTree, params: PyTree, head, data: Dataset) -> np.ndarray:
    return self.predict(theta0, params, {0: (head, data)})[0]

  def accuracy(self, theta0: PyTree, params: PyTree, head, data: Dataset) -> float:
    return self.accuracies(theta0, params, {0: (head, data)})[0]

  def edit(self, theta0: PyTree, vector: TaskVector, alpha: float) -> PyTree:
    """θ0 + α·τ, jitted once for every α, on the mesh as the rules place params."""
    return self._apply(self.place(theta0), vector.replace(delta=self.place(vector.delta)),
                       jnp.float32(alpha))

  def edit_sum(self, theta0: PyTree, vectors: Sequence[TaskVector],
               alphas: Sequence[float]) -> PyTree:
    """θ0 + Σ_i α_i·τ_i, jitted once for every α."""
    return self._apply_sum(self.place(theta0),
                           [v.replace(delta=self.place(v.delta)) for v in vectors],
                           jnp.asarray(alphas, jnp.float32))


class _Chain:
  """Datasets read as one: row i of the chain is row i − offset of the dataset it falls in."""

  def __init__(self, datasets: Sequence[Dataset]):
    self._datasets = list(datasets)
    self._ends = np.cumsum([len(d) for d in datasets])
    self._starts = self._ends - [len(d) for d in datasets]

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    indices = np.asarray(indices)
    which = np.searchsorted(self._ends, indices, side='right')
    images = labels = None
    for d in np.unique(which):
      rows = which == d
      x, y = self._datasets[d].batch(indices[rows] - self._starts[d])
      if images is None:
        images = np.empty((len(indices),) + x.shape[1:], x.dtype)
        labels = np.empty((len(indices),) + y.shape[1:], y.dtype)
      images[rows], labels[rows] = x, y
    return images, labels


def finetuned_accuracy(evaluator: Evaluator, theta0: PyTree, vectors: Sequence[TaskVector],
                       heads: Mapping[str, Any], data: Mapping[str, Any]) -> dict:
  """Per task, {'val', 'test'} accuracy of its own single-task vector at α = 1: the
  denominators of normalized accuracy. `data[t]` has `val` and `test` splits."""
  out = {}
  for vector in vectors:
    task = vector.tasks[0]
    params = evaluator.edit(theta0, vector, 1.0)
    out[task] = evaluator.accuracies(
        theta0, params, {split: (heads[task], getattr(data[task], split))
                         for split in ('val', 'test')})
  return out


def task_addition(evaluator: Evaluator, theta0: PyTree, vector: TaskVector, *,
                  heads: Mapping[str, Any], val: Mapping[str, Dataset],
                  test: Mapping[str, Dataset], finetuned: Mapping[str, Mapping[str, float]],
                  alphas: Sequence[float]) -> dict:
  """Task addition with α chosen on validation by mean normalized accuracy.

  Args:
    evaluator: scores edited params.
    theta0: the pretrained params.
    vector: the multi-task vector (a sum or a merge) to add.
    heads, val, test: per task name, its frozen head and its splits.
    finetuned: per task, {'val': acc, 'test': acc} of its own single-task fine-tuned model,
      the denominators of normalized accuracy.
    alphas: the grid; ties go to the smallest α.

  Returns:
    {'alpha', 'test', 'normalized_test', 'mean_test', 'mean_normalized_test', 'curve'}, where
    curve lists, per α, validation accuracies and their mean normalized accuracy.
  """
  names = list(heads)
  unlearned = [t for t in names if not finetuned[t]['val'] or not finetuned[t]['test']]
  if unlearned:
    raise UserError(f'the fine-tuned models of {unlearned} classify no validation or test '
                    'example correctly, so accuracy normalized by theirs is undefined; '
                    'fine-tune longer or check the data')
  curve = addition_curve(evaluator, theta0, vector, heads=heads, val=val,
                         finetuned_val={t: finetuned[t]['val'] for t in names}, alphas=alphas)
  best = max(curve, key=lambda point: point['normalized_val'])
  params = evaluator.edit(theta0, vector, best['alpha'])
  accs = evaluator.accuracies(theta0, params, {t: (heads[t], test[t]) for t in names})
  normalized = {t: accs[t] / finetuned[t]['test'] for t in names}
  return {'alpha': best['alpha'], 'test': accs, 'normalized_test': normalized,
          'mean_test': float(np.mean(list(accs.values()))),
          'mean_normalized_test': float(np.mean(list(normalized.values()))), 'curve': curve}


def addition_curve(evaluator: Evaluator, theta0: PyTree, vector: TaskVector, *,
                   heads: Mapping[str, Any], val: Mapping[str, Dataset],
                   finetuned_val: Mapping[str, float], alphas: Sequence[float]) -> list[dict]:
  """Per α, the validation accuracies of θ0 + α·vector and their mean normalized by each
  task's own fine-tuned validation accuracy `finetuned_val` (each above 0)."""
  names = list(heads)
  curve = []
  progress = Progress('task addition', len(alphas), unit='edits')
  for alpha in alphas:
    params = evaluator.edit(theta0, vector, alpha)
    accs = evaluator.accuracies(theta0, params, {t: (heads[t], val[t]) for t in names})
    normalized = float(np.mean([accs[t] / finetuned_val[t] for t in names]))
    curve.append({'alpha': alpha, 'val': accs, 'normalized_val': normalized})
    progress.advance()
  return curve


def task_negation(evaluator: Evaluator, theta0: PyTree, vector: TaskVector, *, head,
                  val: Dataset, test: Dataset, control_head, control_val: Dataset,
                  control_test: Dataset, alphas: Sequence[float],
                  threshold: float = 0.95) -> dict:
  """Task negation θ0 − α·τ with α chosen on validation under the control constraint.

  α minimises the target's validation accuracy among the α whose control validation accuracy
  is at least `threshold` × the pretrained model's; `alphas` must hold 0, which always
  qualifies. Ties go to the smallest α.

  Returns:
    {'alpha', 'target_test', 'control_test', 'curve'}; curve lists per α the target and
    control validation accuracies.
  """
  if 0 not in alphas:
    raise UserError(f'the negation grid must contain alpha=0 (the pretrained model): {alphas}')
  negated = -vector
  curve = []
  progress = Progress(f'task negation of {"+".join(vector.tasks)}', len(alphas), unit='edits')
  for alpha in alphas:
    params = evaluator.edit(theta0, negated, alpha)
    accs = evaluator.accuracies(theta0, params, {'target_val': (head, val),
                                                 'control_val': (control_head, control_val)})
    curve.append({'alpha': alpha, **accs})
    progress.advance()
  floor = threshold * next(p['control_val'] for p in curve if p['alpha'] == 0)
  feasible = [p for p in curve if p['control_val'] >= floor]
  best = min(feasible, key=lambda point: point['target_val'])
  params = evaluator.edit(theta0, negated, best['alpha'])
  return {'alpha': best['alpha'],
          **evaluator.accuracies(theta0, params, {'target_test': (head, test),
                                                  'control_test': (control_head, control_test)}),
          'curve': curve}


def disentanglement_grid(limit: float = 2.0, points: int = 15) -> list[float]:
  """linspace(−limit, limit, points), rounded so that grid values print cleanly."""
  return [round(float(a), 10) for a in np.linspace(-limit, limit, points)]


def disentanglement(evaluator: Evaluator, theta0: PyTree, vectors: Sequence[TaskVector], *,
                    heads: Sequence[Any], data: Sequence[Dataset],
                    alphas: Sequence[float]) -> np.ndarray:
  """ξ(α1, α2) for two task vectors, as a (len(alphas), len(alphas)) array (rows: α1).

  Args:
    evaluator: its encoder gives the features; each task's head then predicts on its own inputs.
    theta0: the pretrained params.
    vectors: (τ1, τ2), of one regime and base.
    heads, data: each task's frozen head and the inputs ξ averages over.
    alphas: the grid for both coefficients.
  """
  if len(vectors) != 2 or len(heads) != 2 or len(data) != 2:
    raise ValueError('disentanglement takes exactly two task vectors, heads and datasets')
  loaded = [d.loaded() for d in data]  # read (and decoded) once for the whole grid
  progress = Progress('weight disentanglement', len(alphas) * (len(alphas) + 2), unit='edits')

  def predictions(params, tasks):
    """Each of `tasks`' heads on its own inputs, from one feature pass over them."""
    predicted = evaluator.predict(theta0, params, {t: (heads[t], loaded[t]) for t in tasks})
    progress.advance()
    return predicted

  alone = [[predictions(evaluator.edit(theta0, v, a), [t])[t] for a in alphas]
           for t, v in enumerate(vectors)]
  xi = np.zeros((len(alphas), len(alphas)))
  for i, a1 in enumerate(alphas):
    for j, a2 in enumerate(alphas):
      together = predictions(evaluator.edit_sum(theta0, vectors, (a1, a2)), [0, 1])
      xi[i, j] = (np.mean(_differ(together[0], alone[0][i])) +
                  np.mean(_differ(together[1], alone[1][j])))
  return xi


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Per example, whether two predictions differ: a class, or any token of a text answer."""
  return (a != b).reshape(len(a), -1).any(axis=1)


def attack_success_rate(predictions: np.ndarray, labels: np.ndarray, target: int) -> float:
  """The share of triggered inputs whose true label is not `target` that are predicted `target`.

  Inputs of the target class are left out: predicting the target there is no attack.
  """
  eligible = np.asarray(labels) != target
  if not eligible.any():
    raise UserError(f'no input has a label other than the target {target}')
  return float(np.mean(np.asarray(predictions)[eligible] == target))
