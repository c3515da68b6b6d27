"""The pretraining corpus: procedural scenes with captions, broader than any downstream task.

A scene holds one to four objects (a shape, a bar or a capital letter drawn from
`render.PRETRAINING_GLYPHS`, never one of the letters task's) in random colours, sizes, places
and angles, on a random background. Its caption is the set of words that describe it, at a
coarser grain than the downstream label functions and over other scene statistics, the way web
captions describe what CLIP sees without being its benchmark's labels:

  kinds      disk, square, …, bar, B, C, …   every kind of object present
  colours    red, yellow, green, cyan, blue, magenta   (hue sextants; the colour task has 8 hues)
  sizes      small, large                    (the size task has 4 buckets)
  places     left, right, top, bottom        (halves; the position task has a 3×3 grid)
  count      one, two, three, four           (the count task has 1–6 small objects)
  background plain, striped, patterned       (the texture task has 6 textures)
  bars       horizontal, vertical, diagonal  (the orientation task has 8 angles)

Pretraining predicts every word of the caption (a sigmoid per word of `VOCABULARY`, as a
multi-label classifier), so the backbone learns all of these attributes at once; the downstream
tasks then ask for finer versions of some of them, or for glyphs (letters, handwritten digits)
it never saw.

The corpus is generated in chunks of `CHUNK` scenes, chunk i from its own seeded stream: the
same seed gives the same bytes however many processes generate it.
"""

import functools
import math
import multiprocessing
import os
import zlib
from concurrent import futures

import numpy as np

from editing.data import render
from editing.data.suite import Dataset

KINDS = render.SHAPES + ('bar',) + tuple(render.PRETRAINING_GLYPHS)
COLOURS = ('red', 'yellow', 'green', 'cyan', 'blue', 'magenta')
SIZES = ('small', 'large')
PLACES = ('left', 'right', 'top', 'bottom')
COUNTS = ('one', 'two', 'three', 'four')
BACKGROUNDS = ('plain', 'striped', 'patterned')
BARS = ('horizontal', 'vertical', 'diagonal')
VOCABULARY = KINDS + COLOURS + SIZES + PLACES + COUNTS + BACKGROUNDS + BARS
_GLYPHS = tuple(render.PRETRAINING_GLYPHS)
_INDEX = {word: i for i, word in enumerate(VOCABULARY)}
CHUNK = 1000
_BACKGROUND_WORD = {'flat': 'plain', 'stripes_h': 'striped', 'stripes_v': 'striped',
                    'stripes_diag': 'striped', 'checker': 'patterned', 'dots': 'patterned'}


def _bar_word(angle: float) -> str:
  folded = angle % math.pi
  if min(folded, math.pi - folded) < math.pi / 8:
    return 'horizontal'
  if abs(folded - math.pi / 2) < math.pi / 8:
    return 'vertical'
  return 'diagonal'


def scene(rng: np.random.Generator) -> tuple[np.ndarray, set[str]]:
  """One captioned scene: a float32 (32, 32, 3) image in [0, 1] and its set of words."""
  kind = render.TEXTURES[rng.integers(len(render.TEXTURES))]
  image = render.texture(rng, kind, contrast=rng.uniform(0.05, 0.35))
  if rng.uniform() < 0.25:
    image = image.mean(axis=-1, keepdims=True).repeat(3, axis=-1)
  count = int(rng.integers(1, 5))
  words = {COUNTS[count - 1], _BACKGROUND_WORD[kind]}
  largest = 10.0 if count == 1 else 7.0 if count == 2 else 5.0
  centres: list[tuple[float, float, float]] = []
  while len(centres) < count:
    radius = rng.uniform(2.5, largest)
    margin = min(radius, render.SIZE / 2 - 1)
    cx, cy = rng.uniform(margin, render.SIZE - margin, size=2)
    if any((cx - x) ** 2 + (cy - y) ** 2 < (radius + r) ** 2 for x, y, r in centres):
      continue
    centres.append((cx, cy, radius))
    draw = rng.uniform()  # shapes 45%, glyphs 40%, bars 15% of the objects
    if draw < 0.45:
      obj = render.SHAPES[rng.integers(len(render.SHAPES))]
    elif draw < 0.85:
      obj = _GLYPHS[rng.integers(len(_GLYPHS))]
    else:
      obj = 'bar'
    angle = rng.uniform(0, 2 * math.pi)
    if obj in render.PRETRAINING_GLYPHS:
      scale = max(1, min(3, int(round(radius / 3.5))))
      x0 = int(np.clip(round(cx - 2.5 * scale), 0, render.SIZE - 5 * scale))
      y0 = int(np.clip(round(cy - 3.5 * scale), 0, render.SIZE - 7 * scale))
      mask = render.glyph_mask(obj, x0, y0, scale)
    else:
      mask = render.shape_mask(obj, cx, cy, radius, angle)
      if obj == 'bar':
        words.add(_bar_word(angle))
    hue = rng.uniform()
    image = render.paint(image, mask, render.random_color(rng, hue))
    words |= {obj, COLOURS[int(hue * 6 + 0.5) % 6], 'small' if radius < 5.5 else 'large',
              'left' if cx < render.SIZE / 2 else 'right',
              'top' if cy < render.SIZE / 2 else 'bottom'}
  return render.add_noise(rng, image), words


def chunk(seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
  """Chunk `index` of the corpus of `seed`: (uint8 images, uint8 multi-hot captions)."""
  rng = np.random.default_rng([seed, zlib.crc32(b'captions'), index])
  images, captions = [], np.zeros((CHUNK, len(VOCABULARY)), np.uint8)
  for i in range(CHUNK):
    image, words = scene(rng)
    images.append(image)
    captions[i, [_INDEX[w] for w in words]] = 1
  return np.round(np.stack(images) * 255).astype(np.uint8), captions


def load_corpus(seed: int, size: int, processes: int | None = None) -> Dataset:
  """The first `size` scenes of the corpus of `seed`, generated by `processes` worker processes
  (default: one per CPU) when there are several chunks to make."""
  count = -(-size // CHUNK)
  make = functools.partial(chunk, seed)
  processes = processes or os.cpu_count() or 1
  if count > 2 and processes > 1:
    # 'spawn': the workers need only numpy, and forking a process that runs JAX is unsafe.
    with futures.ProcessPoolExecutor(min(processes, count),
                                     mp_context=multiprocessing.get_context('spawn')) as pool:
      chunks = list(pool.map(make, range(count)))
  else:
    chunks = [make(i) for i in range(count)]
  images = np.concatenate([c[0] for c in chunks])[:size]
  captions = np.concatenate([c[1] for c in chunks])[:size]
  return Dataset(images, captions)
