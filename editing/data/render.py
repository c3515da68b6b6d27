"""Procedural 32x32 RGB scenes: textured backgrounds, geometric shapes, bitmap glyphs.

Every function is a pure function of its arguments and a `numpy.random.Generator`, so a suite
generated from a seed is the same bytes on every machine. Images are float32 in [0, 1], HWC.
"""

import colorsys

import numpy as np

from editing.errors import UserError

SIZE = 32
_Y, _X = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5

TEXTURES = ('flat', 'stripes_h', 'stripes_v', 'stripes_diag', 'checker', 'dots')
SHAPES = ('disk', 'square', 'triangle', 'plus', 'ring', 'ellipse', 'frame', 'half_disk')

# 5x7 bitmaps of the capital letters, one string per row.
_ALPHABET = {
    'A': ('.###.', '#...#', '#...#', '#####', '#...#', '#...#', '#...#'),
    'B': ('####.', '#...#', '#...#', '####.', '#...#', '#...#', '####.'),
    'C': ('.####', '#....', '#....', '#....', '#....', '#....', '.####'),
    'D': ('####.', '#...#', '#...#', '#...#', '#...#', '#...#', '####.'),
    'E': ('#####', '#....', '#....', '####.', '#....', '#....', '#####'),
    'F': ('#####', '#....', '#....', '####.', '#....', '#....', '#....'),
    'G': ('.####', '#....', '#....', '#.###', '#...#', '#...#', '.###.'),
    'H': ('#...#', '#...#', '#...#', '#####', '#...#', '#...#', '#...#'),
    'I': ('#####', '..#..', '..#..', '..#..', '..#..', '..#..', '#####'),
    'J': ('..###', '....#', '....#', '....#', '#...#', '#...#', '.###.'),
    'K': ('#...#', '#..#.', '#.#..', '##...', '#.#..', '#..#.', '#...#'),
    'L': ('#....', '#....', '#....', '#....', '#....', '#....', '#####'),
    'M': ('#...#', '##.##', '#.#.#', '#.#.#', '#...#', '#...#', '#...#'),
    'N': ('#...#', '##..#', '#.#.#', '#..##', '#...#', '#...#', '#...#'),
    'O': ('.###.', '#...#', '#...#', '#...#', '#...#', '#...#', '.###.'),
    'P': ('####.', '#...#', '#...#', '####.', '#....', '#....', '#....'),
    'Q': ('.###.', '#...#', '#...#', '#...#', '#.#.#', '#..#.', '.##.#'),
    'R': ('####.', '#...#', '#...#', '####.', '#.#..', '#..#.', '#...#'),
    'S': ('.####', '#....', '#....', '.###.', '....#', '....#', '####.'),
    'T': ('#####', '..#..', '..#..', '..#..', '..#..', '..#..', '..#..'),
    'U': ('#...#', '#...#', '#...#', '#...#', '#...#', '#...#', '.###.'),
    'V': ('#...#', '#...#', '#...#', '#...#', '#...#', '.#.#.', '..#..'),
    'W': ('#...#', '#...#', '#...#', '#.#.#', '#.#.#', '##.##', '#...#'),
    'X': ('#...#', '#...#', '.#.#.', '..#..', '.#.#.', '#...#', '#...#'),
    'Y': ('#...#', '#...#', '.#.#.', '..#..', '..#..', '..#..', '..#..'),
    'Z': ('#####', '....#', '...#.', '..#..', '.#...', '#....', '#####'),
}
# Ten of them are the letters task's labels; the pretraining corpus draws its glyphs from the
# other sixteen, so that strokes are familiar to the backbone while the letters task stays
# unseen.
GLYPHS = {k: v for k, v in _ALPHABET.items() if k in 'AEFHKLNTXZ'}
PRETRAINING_GLYPHS = {k: v for k, v in _ALPHABET.items() if k not in GLYPHS}


def random_color(rng: np.random.Generator, hue: float | None = None) -> np.ndarray:
  """A saturated RGB colour; a random hue unless one (in [0, 1)) is given."""
  hue = rng.uniform() if hue is None else hue
  return np.array(colorsys.hsv_to_rgb(hue % 1.0, rng.uniform(0.55, 1.0), rng.uniform(0.6, 1.0)),
                  np.float32)


def texture(rng: np.random.Generator, kind: str, contrast: float = 0.25) -> np.ndarray:
  """A background of one of `TEXTURES`, two muted colours at a random period and phase."""
  base = rng.uniform(0.15, 0.6, size=3).astype(np.float32)
  other = np.clip(base + rng.choice([-1, 1]) * contrast * rng.uniform(0.7, 1.3, size=3), 0, 1)
  return paint(base, pattern(rng, kind), other)


def pattern(rng: np.random.Generator, kind: str) -> np.ndarray:
  """A (SIZE, SIZE) float mask of one of `TEXTURES` at a random period and phase."""
  period = rng.uniform(4.0, 8.0)
  phase = rng.uniform(0, period)
  if kind == 'flat':
    mask = np.zeros((SIZE, SIZE), np.float32)
  elif kind == 'stripes_h':
    mask = ((_Y + phase) % period) < period / 2
  elif kind == 'stripes_v':
    mask = ((_X + phase) % period) < period / 2
  elif kind == 'stripes_diag':
    mask = ((_X + _Y + phase) % period) < period / 2
  elif kind == 'checker':
    mask = (((_X + phase) // (period / 2)) + ((_Y + phase) // (period / 2))) % 2 == 0
  elif kind == 'dots':
    cx, cy = (_X + phase) % period - period / 2, (_Y + phase) % period - period / 2
    mask = cx**2 + cy**2 < (period / 4) ** 2
  else:
    raise UserError(f'unknown texture {kind!r}; known: {TEXTURES}')
  return np.asarray(mask, np.float32)


def flat(rng: np.random.Generator, hue: float) -> np.ndarray:
  """A flat, muted background of the given hue (in [0, 1)) at a random saturation and value."""
  rgb = colorsys.hsv_to_rgb(hue % 1.0, rng.uniform(0.3, 0.6), rng.uniform(0.25, 0.55))
  return np.broadcast_to(np.array(rgb, np.float32), (SIZE, SIZE, 3)).copy()


def shape_mask(kind: str, cx: float, cy: float, radius: float, angle: float = 0.0) -> np.ndarray:
  """A (SIZE, SIZE) float mask of a shape centred at (cx, cy), rotated by `angle` radians."""
  dx, dy = _X - cx, _Y - cy
  u = np.cos(angle) * dx + np.sin(angle) * dy
  v = -np.sin(angle) * dx + np.cos(angle) * dy
  r = radius
  if kind == 'disk':
    mask = u**2 + v**2 <= r**2
  elif kind == 'square':
    mask = np.maximum(np.abs(u), np.abs(v)) <= 0.8 * r
  elif kind == 'triangle':
    mask = (v <= 0.5 * r) & (np.abs(u) * 1.732 <= v + r)
  elif kind == 'plus':
    mask = ((np.abs(u) <= r / 3) & (np.abs(v) <= r)) | ((np.abs(v) <= r / 3) & (np.abs(u) <= r))
  elif kind == 'ring':
    mask = ((u**2 + v**2) <= r**2) & ((u**2 + v**2) >= (0.55 * r) ** 2)
  elif kind == 'ellipse':
    mask = u**2 + (2 * v) ** 2 <= r**2
  elif kind == 'frame':
    box = np.maximum(np.abs(u), np.abs(v))
    mask = (box <= 0.85 * r) & (box >= 0.45 * r)
  elif kind == 'half_disk':
    mask = (u**2 + v**2 <= r**2) & (v >= 0)
  elif kind == 'bar':
    mask = (np.abs(u) <= r) & (np.abs(v) <= max(1.0, r / 6))
  else:
    raise UserError(f'unknown shape {kind!r}; known: {SHAPES + ("bar",)}')
  return mask.astype(np.float32)


def glyph_mask(letter: str, x0: int, y0: int, scale: int) -> np.ndarray:
  """A (SIZE, SIZE) mask of a 5x7 bitmap letter (of GLYPHS or PRETRAINING_GLYPHS) drawn with
  `scale`-pixel cells from (x0, y0)."""
  rows = _ALPHABET[letter]
  bitmap = np.array([[c == '#' for c in row] for row in rows], np.float32)
  cells = np.kron(bitmap, np.ones((scale, scale), np.float32))
  mask = np.zeros((SIZE, SIZE), np.float32)
  h, w = cells.shape
  mask[y0:y0 + h, x0:x0 + w] = cells[:SIZE - y0, :SIZE - x0]
  return mask


def paint(image: np.ndarray, mask: np.ndarray, color: np.ndarray) -> np.ndarray:
  """`image` with `color` (an RGB colour, or an image) laid over where `mask` is set."""
  return image * (1 - mask[..., None]) + color * mask[..., None]


def add_noise(rng: np.random.Generator, image: np.ndarray, scale: float = 0.03) -> np.ndarray:
  return np.clip(image + rng.normal(0, scale, image.shape), 0, 1).astype(np.float32)
