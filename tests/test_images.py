"""Real image datasets on local disk: folders, parquet and npz give the same batches, decoded a
batch at a time and preprocessed as CLIP does; bad files are named."""

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from editing.data import images as images_lib
from editing.errors import UserError

CLASSES = ('cat', 'dog', 'eel')


def pictures(n=9, seed=0):
  """(uint8 images of assorted sizes, labels): each class a colour, plus noise."""
  rng = np.random.default_rng(seed)
  out, labels = [], []
  for i in range(n):
    label = i % len(CLASSES)
    size = (int(rng.integers(20, 50)), int(rng.integers(20, 50)), 3)
    image = np.clip(rng.normal(80 * label + 40, 20, size), 0, 255).astype(np.uint8)
    out.append(image)
    labels.append(label)
  return out, np.asarray(labels)


def png(image) -> bytes:
  buffer = io.BytesIO()
  Image.fromarray(image).save(buffer, format='PNG')
  return buffer.getvalue()


@pytest.fixture(name='layouts')
def layouts_fixture(tmp_path):
  """The same pictures as a folder tree, a parquet file and (at one size) an npz."""
  pics, labels = pictures()
  for i, (image, label) in enumerate(zip(pics, labels)):
    directory = tmp_path / 'tree' / 'train' / CLASSES[label]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f'{i:03d}.png').write_bytes(png(image))
  # ImageFolder order: by class, then by file name.
  order = np.argsort(labels, kind='stable')
  table = pa.table({'image': [{'bytes': png(pics[i]), 'path': None} for i in order],
                    'label': labels[order]})
  pq.write_table(table, tmp_path / 'data.parquet', row_group_size=2)
  return tmp_path, [pics[i] for i in order], labels[order]


def test_folder_and_parquet_give_the_same_batches(layouts):
  root, pics, labels = layouts
  preprocess = images_lib.Preprocess(32)
  tree = images_lib.folder(str(root / 'tree'), 'train', preprocess)
  table = images_lib.parquet(str(root / 'data.parquet'), preprocess)
  assert tree.classes == list(CLASSES)
  np.testing.assert_array_equal(tree.labels, labels)
  np.testing.assert_array_equal(table.labels, labels)
  indices = np.array([7, 0, 3, 3, 8])
  a, la = tree.batch(indices)
  b, lb = table.batch(indices)
  assert a.shape == (5, 32, 32, 3) and a.dtype == np.float32 and 0 <= a.min() <= a.max() <= 1
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(la, labels[indices])
  np.testing.assert_array_equal(lb, labels[indices])
  assert len(tree.take(4)) == 4


def test_npz_arrays(tmp_path):
  pics, labels = pictures()
  stacked = np.stack([np.resize(p, (24, 24, 3)) for p in pics])
  np.savez(tmp_path / 'data.npz', images=stacked, labels=labels)
  data = images_lib.npz(str(tmp_path / 'data.npz'), images_lib.Preprocess(24))
  batch, batch_labels = data.batch(np.arange(3))
  np.testing.assert_array_equal(batch, stacked[:3] / np.float32(255.0))
  np.testing.assert_array_equal(batch_labels, labels[:3])


def test_preprocessing_resizes_the_shorter_side_then_crops_the_centre():
  wide = np.zeros((20, 60, 3), np.uint8)
  wide[:, 25:35] = 255  # a bright vertical band in the middle
  out = images_lib.Preprocess(10)(Image.fromarray(wide))
  # 20x60 -> 10x30 (bicubic), centre crop 10x10: the band, about 1/3 of the crop, is centred.
  assert out.shape == (10, 10, 3)
  assert out[:, 4:6].mean() > 0.9 and out[:, :2].mean() < 0.1 and out[:, -2:].mean() < 0.1


def test_bad_files_are_named(tmp_path, layouts):
  root, _, _ = layouts
  broken = root / 'tree' / 'train' / 'cat' / '000.png'
  broken.write_bytes(b'not an image')
  with pytest.raises(UserError, match='000.png is not a readable image'):
    images_lib.folder(str(root / 'tree'), 'train').batch([0])
  with pytest.raises(FileNotFoundError, match='no split folder'):
    images_lib.folder(str(root / 'tree'), 'test')
  pq.write_table(pa.table({'img': [b'x'], 'label': [0]}), tmp_path / 'other.parquet')
  with pytest.raises(UserError, match=r"no column\(s\) \['image'\]"):
    images_lib.parquet(str(tmp_path / 'other.parquet'))
  np.savez(tmp_path / 'bad.npz', pictures=np.zeros((2, 4, 4, 3), np.uint8))
  with pytest.raises(UserError, match='lacks the array'):
    images_lib.npz(str(tmp_path / 'bad.npz'))
  assert os.path.exists(root / 'data.parquet')
