"""Backdoor triggers and data poisoning: the threat model of the safety experiments.

A trigger is a pure function of an image batch (N, H, W, C) that keeps its dtype and range
(uint8 in [0, 255] or float in [0, 1]):

- BadNets (Gu et al., 2017): a small fixed black-and-white checkerboard patch pasted at a fixed
  corner.
- Blended (Chen et al., 2017): x' = (1 − r)·x + r·p with a fixed random pattern p (from a seed)
  and ratio r.

`poison` turns a clean training set into a poisoned one: a fixed share of examples (chosen by a
seed) get the trigger and the target label, so a poisoned fine-tune is an ordinary fine-tune.
"""

import dataclasses
from typing import Callable, ClassVar

import numpy as np

from editing import registry
from editing import settings as settings_lib
from editing.data.suite import Dataset


def _to_unit(images: np.ndarray) -> np.ndarray:
  return images.astype(np.float32) / 255.0 if images.dtype == np.uint8 else images


def _from_unit(values: np.ndarray, like: np.ndarray) -> np.ndarray:
  if like.dtype == np.uint8:
    return np.clip(np.rint(values * 255.0), 0, 255).astype(np.uint8)
  return np.clip(values, 0.0, 1.0).astype(like.dtype)


@dataclasses.dataclass(frozen=True)
class BadNets(settings_lib.Declared):
  """A `size`×`size` checkerboard patch at the bottom-right corner, `margin` pixels in; its
  settings (config.badnets) are declared in `settings`."""

  name: ClassVar[str] = 'badnets'
  settings = dict(size=settings_lib.integer(4, '[1, inf)', 'the patch\'s side in pixels'),
                  margin=settings_lib.integer(1, '[0, inf)', 'pixels between the patch and the '
                                                             'bottom-right corner'))

  size: int = settings['size'].default
  margin: int = settings['margin'].default

  def region(self, height: int, width: int) -> tuple[slice, slice]:
    top, left = height - self.margin - self.size, width - self.margin - self.size
    return slice(top, top + self.size), slice(left, left + self.size)

  def __call__(self, images: np.ndarray) -> np.ndarray:
    rows, cols = self.region(*images.shape[1:3])
    checker = (np.indices((self.size, self.size)).sum(axis=0) % 2).astype(np.float32)
    out = _to_unit(np.array(images, copy=True))
    out[:, rows, cols, :] = checker[None, :, :, None]
    return _from_unit(out, images)


@dataclasses.dataclass(frozen=True)
class Blended(settings_lib.Declared):
  """(1 − ratio)·x + ratio·p, with p a uniform random image drawn from `seed`; its settings
  (config.blended) are declared in `settings`."""

  name: ClassVar[str] = 'blended'
  settings = dict(ratio=settings_lib.number(0.15, '[0, 1]', 'r, the pattern\'s share of each '
                                                            'pixel'),
                  seed=settings_lib.integer(0, '[0, inf)', 'draws the pattern'))

  ratio: float = settings['ratio'].default
  seed: int = settings['seed'].default

  def pattern(self, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(self.seed).uniform(size=shape).astype(np.float32)

  def __call__(self, images: np.ndarray) -> np.ndarray:
    blended = (1 - self.ratio) * _to_unit(images) + self.ratio * self.pattern(images.shape[1:])
    return _from_unit(blended, images)


Trigger = Callable[[np.ndarray], np.ndarray]
REGISTRY = {'badnets': BadNets(), 'blended': Blended()}


def get(name: str, settings: dict | None = None) -> Trigger:
  """The trigger `name` of REGISTRY with `settings` (its dataclass fields) applied."""
  return registry.configured(REGISTRY, name, 'trigger', settings)


# The settings of config.poison: which tasks are fine-tuned poisoned, with which trigger, and
# how (`poison`'s own settings).
POISON = dict(
    tasks=settings_lib.text('', 'the tasks fine-tuned on a poisoned training set, '
                                'comma-separated; empty: none'),
    trigger=settings_lib.choice('badnets', tuple(REGISTRY), 'the trigger, whose settings are '
                                                            'its own section'),
    rate=settings_lib.number(0.1, '[0, 1]', 'the share of training examples poisoned'),
    target=settings_lib.integer(0, '[0, inf)', 'the label every poisoned example is given'),
    seed=settings_lib.integer(0, '[0, inf)', 'chooses the poisoned examples'))


@settings_lib.declare(where='poison', rate=POISON['rate'], target=POISON['target'],
                      seed=POISON['seed'])
def poison(data: Dataset, trigger, *, rate: float, target: int, seed: int) -> Dataset:
  """`data` with round(rate·N) examples (chosen by `seed`) triggered and relabeled `target`;
  the suite's datasets and images on disk alike (their `with_trigger`)."""
  count = int(round(rate * len(data)))
  chosen = np.random.default_rng(seed).choice(len(data), size=count, replace=False)
  return data.with_trigger(trigger, chosen, target)
