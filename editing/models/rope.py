"""Rotary position embeddings as a decoder's config.json describes them: the default one
(θ^(-2i/d)), linear scaling, or Llama 3's banded rescaling (`Rope`), read from one
rope_parameters or rope_scaling entry (`from_entry`)."""

import dataclasses
import math
from typing import Mapping

import numpy as np

from editing.errors import UserError

KINDS = ('default', 'linear', 'llama3')


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary position embedding: the pair (x_i, x_{i+d/2}) of a head is rotated by p·ω_i,
  ω_i = θ^(-2i/d), rescaled by `kind`: 'linear' divides every ω by `factor`; 'llama3' divides
  the low frequencies (wavelength 2π/ω > L/low_freq_factor, L the original context) by
  `factor`, keeps the high ones (2π/ω < L/high_freq_factor) and interpolates between them
  with s = (L/wavelength − low) / (high − low): ω' = (1 − s)·ω/factor + s·ω."""

  theta: float = 10000.0
  kind: str = 'default'
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def inverse_frequencies(self, head_dim: int) -> np.ndarray:
    """The head_dim / 2 angular frequencies ω_i, float32."""
    omega = 1.0 / self.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    omega = omega.astype(np.float32)
    if self.kind == 'linear':
      return (omega / self.factor).astype(np.float32)
    if self.kind == 'llama3':
      context = self.original_max_position_embeddings
      wavelength = 2 * math.pi / omega
      scaled = np.where(wavelength > context / self.low_freq_factor, omega / self.factor, omega)
      smooth = ((context / wavelength - self.low_freq_factor) /
                (self.high_freq_factor - self.low_freq_factor))
      blended = (1 - smooth) * scaled / self.factor + smooth * scaled
      medium = ((wavelength >= context / self.high_freq_factor) &
                (wavelength <= context / self.low_freq_factor))
      return np.where(medium, blended, scaled).astype(np.float32)
    return omega

  def to_hf(self) -> dict:
    """This RoPE as one of transformers 5's `rope_parameters` entries."""
    out = {'rope_type': self.kind, 'rope_theta': self.theta}
    if self.kind != 'default':
      out['factor'] = self.factor
    if self.kind == 'llama3':
      out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                 original_max_position_embeddings=self.original_max_position_embeddings)
    return out


def from_entry(entry: Mapping, where: str, theta: float) -> Rope:
  """A `Rope` from a rope_parameters / rope_scaling entry (`where` names it in errors)."""
  known = {'rope_type', 'type', 'rope_theta', 'factor', 'low_freq_factor', 'high_freq_factor',
           'original_max_position_embeddings', 'partial_rotary_factor'}
  unknown = sorted(set(entry) - known)
  if unknown:
    raise UserError(f'config.json: {where}.{unknown[0]} is not understood here')
  if entry.get('partial_rotary_factor', 1.0) != 1.0:
    raise UserError(f'config.json: {where}.partial_rotary_factor = '
                    f'{entry["partial_rotary_factor"]}: only whole-head RoPE is supported')
  kind = entry.get('rope_type', entry.get('type', 'default'))
  if kind not in KINDS:
    raise UserError(f'config.json: {where}.rope_type = {kind!r} is not supported; supported: '
                    f'{list(KINDS)}')
  fields = {'theta': float(entry.get('rope_theta', theta)), 'kind': kind}
  if kind != 'default':
    fields['factor'] = float(entry['factor'])
  if kind == 'llama3':
    fields.update(low_freq_factor=float(entry['low_freq_factor']),
                  high_freq_factor=float(entry['high_freq_factor']),
                  original_max_position_embeddings=int(
                      entry['original_max_position_embeddings']))
  return Rope(**fields)
