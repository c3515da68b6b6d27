"""Real image datasets from local disk, decoded a batch at a time.

Three layouts people keep the 8-task benchmark in:

  folder(root, split)   class-per-folder trees with split subfolders (torchvision's ImageFolder:
                        <root>/<split>/<class>/<image>), classes in sorted order
  parquet(path)         Hugging Face dataset exports: an image column (a struct with encoded
                        `bytes`, or raw bytes) and an integer label column
  npz(path)             arrays `images` (N, H, W, 3) uint8 and `labels` (N,)

Each gives an `ImageDataset`, which the one training loop and the evaluator read like the
built-in suite's `Dataset`: `len`, `labels`, `batch(indices) -> (float32 images in [0, 1],
labels)`, `take(n)`; and its class names where the data has them (the folders' names, a parquet
export's ClassLabel names). `load_task` finds a dataset's splits in any of the three layouts and
makes the train/val/test `Task` the jobs read. Only the labels live in memory; an image is read
and decoded when a batch asks for it, then resized as CLIP's preprocessing does (`Preprocess`:
the shorter side to `size` by bicubic resampling, a centre crop; the model standardises with its
own pixel mean and std). Parquet row groups are read once each through a small cache, so a
batch touches only the groups its rows are in.

The training loop prepares the next batch in a background thread while the device runs the
current step (`editing.train`), which keeps decoding off the critical path. grain is not used:
batch order here is a pure function of the step (resuming recomputes it), which is what grain's
checkpointable iterators would otherwise provide, and a thread per loop covers decoding at the
batch sizes these jobs use.
"""

import collections
import dataclasses
import io
import json
import os
import zlib
from typing import Callable, Sequence

import numpy as np
from PIL import Image

from editing import settings
from editing.data import suite
from editing.errors import UserError

# config.data: how the jobs read datasets on disk.
SETTINGS = dict(
    seed=settings.integer(0, '[0, inf)', 'draws the validation split held out'),
    val_fraction=settings.number(0.1, '(0, 1)', 'the share of training examples held out, '
                                                'where a dataset has no val split'),
    image_size=settings.integer(224, '[1, inf)', 'the side images are resized to'))

_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.gif', '.tif', '.tiff', '.webp', '.ppm')


@dataclasses.dataclass(frozen=True)
class Preprocess:
  """An RGB image -> (size, size, 3) float32 in [0, 1]: shorter side to `size` (bicubic),
  centre crop."""

  size: int = 224

  def __call__(self, image: Image.Image) -> np.ndarray:
    image = image.convert('RGB')
    width, height = image.size
    scale = self.size / min(width, height)
    resized = (max(self.size, round(width * scale)), max(self.size, round(height * scale)))
    image = image.resize(resized, Image.BICUBIC)
    left, top = (resized[0] - self.size) // 2, (resized[1] - self.size) // 2
    image = image.crop((left, top, left + self.size, top + self.size))
    return np.asarray(image, np.float32) / 255.0


class ImageDataset:
  """Images read through `read(index) -> PIL image`, labels in memory; `trigger`, where set,
  is applied after preprocessing to the examples `triggered` marks (a backdoor's poisoned or
  triggered inputs, `with_trigger`)."""

  def __init__(self, read: Callable[[int], Image.Image], labels: np.ndarray,
               preprocess: Preprocess, classes: Sequence[str] | None = None,
               trigger: Callable[[np.ndarray], np.ndarray] | None = None,
               triggered: np.ndarray | None = None):
    self._read = read
    self.labels = np.asarray(labels, np.int32)
    self.preprocess = preprocess
    self.classes = list(classes) if classes is not None else None
    self._trigger = trigger
    self._triggered = triggered

  def __len__(self) -> int:
    return len(self.labels)

  def batch(self, indices) -> tuple[np.ndarray, np.ndarray]:
    indices = np.asarray(indices)
    images = np.stack([self.preprocess(self._read(int(i))) for i in indices])
    if self._trigger is not None:
      rows = self._triggered[indices]
      images[rows] = self._trigger(images[rows])
    return images, self.labels[indices]

  def subset(self, indices: np.ndarray) -> 'ImageDataset':
    """The examples at `indices`, in that order."""
    indices = np.asarray(indices)
    return ImageDataset(lambda i: self._read(int(indices[i])), self.labels[indices],
                        self.preprocess, self.classes, self._trigger,
                        None if self._triggered is None else self._triggered[indices])

  def take(self, n: int) -> 'ImageDataset':
    """The first n examples (all of them if there are fewer)."""
    return self.subset(np.arange(min(n, len(self))))

  def score(self, predictions: np.ndarray) -> float:
    """Accuracy of predicted classes."""
    return float(np.mean(predictions == self.labels))

  def loaded(self) -> suite.Dataset:
    """Every example read and decoded once, held in memory, for a protocol that scores the
    same images many times. They are 8-bit, so storing them back as uint8 loses nothing."""
    images, labels = self.batch(np.arange(len(self)))
    return suite.Dataset(np.round(images * 255).astype(np.uint8), labels)

  def with_trigger(self, trigger: Callable[[np.ndarray], np.ndarray],
                   indices: np.ndarray | None = None, target: int | None = None
                   ) -> 'ImageDataset':
    """The examples at `indices` (default: all) passed through `trigger` when read and,
    unless `target` is None, relabeled `target`."""
    if self._trigger is not None:
      raise UserError('this dataset already carries a trigger')
    triggered = np.zeros(len(self), bool)
    triggered[np.arange(len(self)) if indices is None else np.asarray(indices)] = True
    labels = np.where(triggered, target, self.labels) if target is not None else self.labels
    return ImageDataset(self._read, labels, self.preprocess, self.classes, trigger, triggered)


def folder(root: str, split: str, preprocess: Preprocess = Preprocess()) -> ImageDataset:
  """<root>/<split>/<class>/<image files>, classes in sorted order."""
  directory = os.path.join(root, split)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'no split folder {directory}')
  classes = sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d)))
  if not classes:
    raise UserError(f'{directory} holds no class folders (<class>/<image>)')
  paths, labels = [], []
  for label, name in enumerate(classes):
    files = sorted(f for f in os.listdir(os.path.join(directory, name))
                   if f.lower().endswith(_EXTENSIONS))
    paths += [os.path.join(directory, name, f) for f in files]
    labels += [label] * len(files)
  if not paths:
    raise UserError(f'{directory} holds no images with extensions {_EXTENSIONS}')
  return ImageDataset(lambda i: _open(paths[i]), np.asarray(labels), preprocess, classes)


def _open(path: str) -> Image.Image:
  try:
    image = Image.open(path)
    image.load()
    return image
  except (OSError, ValueError) as e:
    raise UserError(f'{path} is not a readable image ({e})') from None


def npz(path: str, preprocess: Preprocess = Preprocess()) -> ImageDataset:
  """Arrays `images` (N, H, W, 3) uint8 and `labels` (N,) in one .npz (refused if pickled)."""
  try:
    with np.load(path, allow_pickle=False) as arrays:
      images, labels = arrays['images'], arrays['labels']
  except KeyError as e:
    raise UserError(f'{path} lacks the array {e}; it needs "images" and "labels"') from None
  except ValueError as e:
    raise UserError(f'{path}: {e} (object arrays are pickles, refused)') from None
  if images.ndim != 4 or images.shape[-1] != 3 or len(images) != len(labels):
    raise UserError(f'{path}: images {images.shape} and labels {labels.shape} are not '
                    '(N, H, W, 3) and (N,)')
  return ImageDataset(lambda i: Image.fromarray(np.asarray(images[i], np.uint8)), labels,
                      preprocess)


def parquet(path: str, preprocess: Preprocess = Preprocess(), *, image_column: str = 'image',
            label_column: str = 'label', cached_groups: int = 8) -> ImageDataset:
  """A Hugging Face dataset's parquet export; its image column is read a row group at a time."""
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  try:
    file = pq.ParquetFile(path)
  except (OSError, ValueError) as e:
    raise UserError(f'{path} is not a readable parquet file ({e})') from None
  columns = file.schema_arrow.names
  missing = [c for c in (image_column, label_column) if c not in columns]
  if missing:
    raise UserError(f'{path} has no column(s) {missing}; it has {columns}')
  labels = file.read(columns=[label_column]).column(label_column).to_numpy()
  classes = _class_label_names(file.schema_arrow.metadata or {}, label_column)
  starts = np.cumsum([0] + [file.metadata.row_group(g).num_rows
                            for g in range(file.num_row_groups)])
  cache: collections.OrderedDict = collections.OrderedDict()

  def group(g: int) -> list:
    if g not in cache:
      cache[g] = file.read_row_group(g, columns=[image_column]).column(image_column).to_pylist()
      if len(cache) > cached_groups:
        cache.popitem(last=False)
    return cache[g]

  def read(i: int) -> Image.Image:
    g = int(np.searchsorted(starts, i, side='right') - 1)
    value = group(g)[i - starts[g]]
    data = value['bytes'] if isinstance(value, dict) else value
    try:
      return Image.open(io.BytesIO(data))
    except (OSError, ValueError, TypeError) as e:
      raise UserError(f'{path}: row {i} of {image_column} is not an encoded image ({e})') from None

  return ImageDataset(read, labels, preprocess, classes)


def _class_label_names(metadata: dict, label_column: str) -> list[str] | None:
  """The ClassLabel names the `datasets` library records in a parquet export's schema."""
  try:
    features = json.loads(metadata[b'huggingface'])['info']['features']
    return list(features[label_column]['names'])
  except (KeyError, TypeError, ValueError):
    return None


def load_split(root: str, split: str, preprocess: Preprocess) -> ImageDataset | None:
  """The split of the dataset at `root` in whichever layout it is kept: <root>/<split>/
  (folders), <root>/<split>.parquet or <root>/<split>.npz; None if there is none."""
  if os.path.isdir(os.path.join(root, split)):
    return folder(root, split, preprocess)
  for extension, reader in (('.parquet', parquet), ('.npz', npz)):
    path = os.path.join(root, split + extension)
    if os.path.exists(path):
      return reader(path, preprocess)
  return None


def load_task(root: str, name: str, *, val_fraction: float, max_val: int = 5000, seed: int = 0,
              preprocess: Preprocess = Preprocess()) -> suite.Task:
  """The dataset at <root>/<name> as a `suite.Task`: its train and test splits, and its val
  split if it has one, else a seeded `val_fraction` (at most `max_val`) of train held out, as
  the task-arithmetic protocol does."""
  directory = os.path.join(root, name)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'no dataset {name!r}: {directory} is not a directory')
  splits = {s: load_split(directory, s, preprocess) for s in ('train', 'val', 'test')}
  missing = [s for s in ('train', 'test') if splits[s] is None]
  if missing:
    raise FileNotFoundError(f'{directory} has no {" or ".join(missing)} split: expected '
                            f'<split>/ class folders, <split>.parquet or <split>.npz')
  train, val, test = splits['train'], splits['val'], splits['test']
  if val is None:
    order = np.random.default_rng([seed, zlib.crc32(name.encode())]).permutation(len(train))
    held_out = min(max_val, max(1, int(round(val_fraction * len(train)))))
    train, val = train.subset(np.sort(order[held_out:])), train.subset(np.sort(order[:held_out]))
  classes = train.classes or test.classes
  if train.classes and test.classes and train.classes != test.classes:
    raise UserError(f'{directory}: the train and test splits name different classes')
  num_classes = len(classes) if classes else int(max(train.labels.max(), test.labels.max())) + 1
  for split, data in (('train', train), ('val', val), ('test', test)):
    if len(data) and (data.labels.min() < 0 or data.labels.max() >= num_classes):
      raise UserError(f'{directory}: {split} labels lie outside 0..{num_classes - 1}')
  return suite.Task(name, num_classes, train, val, test)
