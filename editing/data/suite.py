"""The built-in offline suite: a negation control and eight downstream tasks, made from a seed.

All tasks are 32x32 RGB classification problems of procedural scenes (`render`), in the
spirit of the 8-task CLIP benchmark:

=============  =======  =====================================================================
task           classes  label
=============  =======  =====================================================================
shapes         8        which shape is drawn, on any background (the negation control)
digits         10       a real handwritten digit (scikit-learn's bundled 8x8 digits, 4x larger)
letters        10       which of ten 5x7 bitmap capital letters is drawn
count          6        how many small disks (1-6) there are
orientation    8        the angle of a long bar, in steps of 22.5 degrees
texture        6        the pattern that fills the frame
position       9        the cell of a 3x3 grid that holds a square's centre
size           4        a ring's radius bucket
colour         8        a triangle's hue, on a grey background
=============  =======  =====================================================================

Each downstream task is a domain of its own, as each dataset of the CLIP benchmark is: its own
`Look` (flat backgrounds of one hue, objects of another; the texture task's patterns in its
two hues), and one kind of object that varies only in its label attribute (the size task's
rings stay near the centre, the position task's squares keep one size, no object but the
orientation task's bar is turned). So no task's label is another's nuisance: fine-tuning on
one task does not teach invariance to what another reads, and a task vector changes the
features of its own domain more than of the others'. Task arithmetic rests on that (the weight
disentanglement of Ortiz-Jimenez et al. comes with task vectors localised to their tasks'
inputs): tasks that all shared one family of scenes, each reading an attribute the others
vary (a texture under a random shape, the hue of a random shape, ...), kept about two thirds
of their fine-tuned accuracy under addition; on these domains they keep about four fifths.
The control task, shapes, keeps the broad scenes (any background, hue, size, place and angle),
as ImageNet is the CLIP benchmark's control.

Splits follow the task-arithmetic protocol: validation is a fixed 10% (at most 5,000) of the
training pool, test is drawn from its own stream. Nothing is downloaded.
"""

import dataclasses
import functools
import math
import zlib
from typing import Callable

import numpy as np

from editing import settings
from editing.data import render
from editing.errors import UserError

# config.suite: what the jobs generate the suite with.
SETTINGS = dict(
    seed=settings.integer(0, '[0, inf)', 'draws the suite\'s data'),
    tasks=settings.text('', 'the tasks, comma-separated'),
    train_size=settings.integer(5000, '[1, inf)', 'training examples per task'),
    test_size=settings.integer(1000, '[1, inf)', 'test examples per task'),
    val_fraction=settings.number(0.1, '(0, 1)', 'the share of training examples held out'),
    pretrain_size=settings.integer(25000, '[1, inf)', 'examples of the control task\'s corpus'))
CONTROL_TASK = 'shapes'
DOWNSTREAM_TASKS = ('digits', 'letters', 'count', 'orientation', 'texture', 'position', 'size',
                    'colour')
_SPLIT_STREAMS = {'train': 0, 'test': 1}


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
  """Images stored as uint8 (N, 32, 32, 3) with int32 labels; batches come out as float32."""

  images: np.ndarray
  labels: np.ndarray

  def __len__(self) -> int:
    return len(self.labels)

  def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return self.images[indices].astype(np.float32) / 255.0, self.labels[indices]

  def take(self, n: int) -> 'Dataset':
    """The first n examples (all of them if there are fewer)."""
    return Dataset(self.images[:n], self.labels[:n])

  def loaded(self) -> 'Dataset':
    """The examples in memory: they always are."""
    return self

  def score(self, predictions: np.ndarray) -> float:
    """Accuracy of predicted classes."""
    return float(np.mean(predictions == self.labels))

  def with_trigger(self, trigger: Callable[[np.ndarray], np.ndarray],
                   indices: np.ndarray | None = None, target: int | None = None) -> 'Dataset':
    """The examples at `indices` (default: all) passed through `trigger` and, unless `target`
    is None, relabeled `target`."""
    chosen = np.arange(len(self)) if indices is None else np.asarray(indices)
    images, labels = np.array(self.images, copy=True), np.array(self.labels, copy=True)
    images[chosen] = trigger(images[chosen])
    if target is not None:
      labels[chosen] = target
    return Dataset(images, labels)


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
  name: str
  num_classes: int
  train: Dataset
  val: Dataset
  test: Dataset


def _seeded(seed: int, name: str, stream: int) -> np.random.Generator:
  return np.random.default_rng([seed, zlib.crc32(name.encode()), stream])


def _position(rng, radius: float) -> tuple[float, float]:
  margin = min(radius, render.SIZE / 2 - 1)
  return tuple(rng.uniform(margin, render.SIZE - margin, size=2))


def _background(rng, contrast: float = 0.12) -> np.ndarray:
  return render.texture(rng, render.TEXTURES[rng.integers(len(render.TEXTURES))], contrast)


def _shapes(rng, label):
  radius = rng.uniform(5, 10)
  mask = render.shape_mask(render.SHAPES[label], *_position(rng, radius), radius,
                           rng.uniform(0, 2 * math.pi))
  return render.paint(_background(rng), mask, render.random_color(rng))


@dataclasses.dataclass(frozen=True)
class Look:
  """A downstream task's own domain: the hue of its flat backgrounds and of its objects."""

  background: float
  objects: float

  def backdrop(self, rng) -> np.ndarray:
    return render.flat(rng, self.background)

  def ink(self, rng) -> np.ndarray:
    return render.random_color(rng, self.objects + rng.uniform(-0.03, 0.03))


# Task i's backgrounds at hue (i + ½)/8 and its objects at hue i/8 + 0.55: no two tasks share
# a look, though task i's objects take about the hue of task i + 4's backgrounds (brighter and
# more saturated). The colour task draws its hues from its labels, on grey, not from its look.
LOOKS = {name: Look((i + 0.5) / 8, (i / 8 + 0.55) % 1.0)
         for i, name in enumerate(DOWNSTREAM_TASKS)}


def _centre(rng) -> tuple[float, float]:
  return tuple(render.SIZE / 2 + rng.uniform(-2, 2, size=2))


def _letters(rng, label):
  look = LOOKS['letters']
  x0, y0 = (render.SIZE - 15) // 2 + rng.integers(-2, 3, size=2)
  mask = render.glyph_mask(sorted(render.GLYPHS)[label], int(x0), int(y0), scale=3)
  return render.paint(look.backdrop(rng), mask, look.ink(rng))


def _count(rng, label):
  look = LOOKS['count']
  image = look.backdrop(rng)
  centres: list[tuple[float, float]] = []
  while len(centres) < label + 1:
    centre = _position(rng, 3.5)
    if all((centre[0] - x) ** 2 + (centre[1] - y) ** 2 > 8.5**2 for x, y in centres):
      centres.append(centre)
      image = render.paint(image, render.shape_mask('disk', *centre, 3.0), look.ink(rng))
  return image


def _orientation(rng, label):
  look = LOOKS['orientation']
  angle = label * math.pi / 8 + rng.uniform(-0.08, 0.08)
  centre = render.SIZE / 2 + rng.uniform(-4, 4, size=2)
  mask = render.shape_mask('bar', *centre, rng.uniform(9, 12), angle)
  return render.paint(look.backdrop(rng), mask, look.ink(rng))


def _texture(rng, label):
  look = LOOKS['texture']
  mask = render.pattern(rng, render.TEXTURES[label])
  return render.paint(render.flat(rng, look.background), mask, render.flat(rng, look.objects))


def _position_task(rng, label):
  look = LOOKS['position']
  cell = render.SIZE / 3
  row, col = divmod(label, 3)
  cx = (col + rng.uniform(0.15, 0.85)) * cell
  cy = (row + rng.uniform(0.15, 0.85)) * cell
  return render.paint(look.backdrop(rng), render.shape_mask('square', cx, cy, 4.5), look.ink(rng))


_SIZE_BUCKETS = ((2.5, 4.0), (4.75, 6.25), (7.0, 8.5), (9.25, 11.0))


def _size(rng, label):
  look = LOOKS['size']
  mask = render.shape_mask('ring', *_centre(rng), rng.uniform(*_SIZE_BUCKETS[label]))
  return render.paint(look.backdrop(rng), mask, look.ink(rng))


def _colour(rng, label):
  # The one task whose objects' hue varies: it is the label. Its backgrounds are grey.
  background = np.full((render.SIZE, render.SIZE, 3), rng.uniform(0.3, 0.6), np.float32)
  mask = render.shape_mask('triangle', *_centre(rng), 6.0)
  hue = label / 8 + rng.uniform(-0.02, 0.02)
  return render.paint(background, mask, render.random_color(rng, hue))


_SYNTHETIC: dict[str, tuple[int, Callable]] = {
    'shapes': (len(render.SHAPES), _shapes),
    'letters': (len(render.GLYPHS), _letters),
    'count': (6, _count),
    'orientation': (8, _orientation),
    'texture': (len(render.TEXTURES), _texture),
    'position': (9, _position_task),
    'size': (len(_SIZE_BUCKETS), _size),
    'colour': (8, _colour),
}
TASKS = (CONTROL_TASK,) + DOWNSTREAM_TASKS


def _to_uint8(images: list[np.ndarray]) -> np.ndarray:
  return np.round(np.clip(np.stack(images), 0, 1) * 255).astype(np.uint8)


def _synthesize(name: str, n: int, rng: np.random.Generator) -> Dataset:
  num_classes, draw = _SYNTHETIC[name]
  labels = rng.integers(num_classes, size=n).astype(np.int32)
  images = [render.add_noise(rng, draw(rng, int(label))) for label in labels]
  return Dataset(_to_uint8(images), labels)


def _digit_scene(rng, digit: np.ndarray) -> np.ndarray:
  """An 8x8 scikit-learn digit (ink 0..16) blown up 4x to fill the frame, in its task's look."""
  look = LOOKS['digits']
  ink = np.kron(digit / 16.0, np.ones((4, 4))).astype(np.float32)
  return render.add_noise(rng, render.paint(look.backdrop(rng), ink, look.ink(rng)))


def _digits(seed: int) -> tuple[Dataset, Dataset]:
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  digits = load_digits()
  order = np.random.default_rng([seed, zlib.crc32(b'digits')]).permutation(len(digits.target))
  num_test = len(order) // 5
  rng = _seeded(seed, 'digits', 2)
  images = _to_uint8([_digit_scene(rng, d) for d in digits.images[order]])
  labels = digits.target[order].astype(np.int32)
  return (Dataset(images[num_test:], labels[num_test:]),
          Dataset(images[:num_test], labels[:num_test]))


def _split_val(pool: Dataset, seed: int, name: str, val_fraction: float) -> tuple[Dataset, Dataset]:
  num_val = min(5000, max(1, int(round(val_fraction * len(pool)))))
  order = _seeded(seed, name, 3).permutation(len(pool))
  val, train = np.sort(order[:num_val]), np.sort(order[num_val:])
  return (Dataset(pool.images[train], pool.labels[train]),
          Dataset(pool.images[val], pool.labels[val]))


@functools.lru_cache(maxsize=32)
def load_task(name: str, *, seed: int = 0, train_size: int = 5000, test_size: int = 1000,
              val_fraction: float = 0.1) -> Task:
  """Generates (or returns the cached) train/val/test splits of one task of the suite.

  Args:
    name: one of `TASKS`.
    seed: the suite's seed; the same seed gives the same bytes.
    train_size: size of the training pool of synthetic tasks, validation included. The real
      `digits` task has a fixed size (1,437 training pool / 360 test).
    test_size: size of the test split of synthetic tasks.
    val_fraction: the share of the training pool held out for validation.
  """
  if name == 'digits':
    pool, test = _digits(seed)
    num_classes = 10
  elif name in _SYNTHETIC:
    pool = _synthesize(name, train_size, _seeded(seed, name, _SPLIT_STREAMS['train']))
    test = _synthesize(name, test_size, _seeded(seed, name, _SPLIT_STREAMS['test']))
    num_classes = _SYNTHETIC[name][0]
  else:
    raise UserError(f'unknown task {name!r}; the suite has {TASKS}')
  train, val = _split_val(pool, seed, name, val_fraction)
  return Task(name, num_classes, train, val, test)


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> np.ndarray:
  """Indices of the training batch at `step`: epochs are fixed permutations, keyed by seed.

  A pure function of the step, so a resumed run sees exactly the batches it would have seen.
  """
  if batch_size > num_examples:
    raise UserError(f'batch_size {batch_size} exceeds the {num_examples} training examples')
  steps_per_epoch = num_examples // batch_size
  epoch, index = divmod(step, steps_per_epoch)
  order = np.random.default_rng([seed, epoch]).permutation(num_examples)
  return order[index * batch_size:(index + 1) * batch_size]
