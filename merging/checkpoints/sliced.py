"""A merge of `slices`, as mergekit's recipes give them with a method other than passthrough:
the output's layers are merged from layer ranges of every model, slice after slice.

Slice k gives each model (the base among them) a range [a_m, b_m) of one length n_k; output
layer o_k + j (o_k the layers of the slices before it) merges layer a_m + j of every model m,
and the layers are renumbered 0 … L − 1. The tensors outside the layers (embeddings, final
norm, head) are each model's own, merged as in any merge. Each model is read through a `View`
that holds its tensors under the output's names, so the merge itself is the plain streamed
one (`merging.checkpoints.job`). A gradient's t runs over each slice's own layers,
j / (n_k − 1), as mergekit plans it, with t = 0 outside the layers.
"""

from typing import Mapping, Sequence

from editing.errors import UserError
from editing.models import hf
from merging.checkpoints import layered
from merging.checkpoints import passthrough

Slices = Sequence[Mapping[str, Sequence[int]]]  # per slice, {model path: [first, end)}


class View:
  """A checkpoint's tensors under the output's names (an `hf.Reader`)."""

  def __init__(self, ckpt: hf.Checkpoint, names: Mapping[str, str], layers: int):
    self.path, self._ckpt, self._names = ckpt.path, ckpt, dict(names)
    self.config = passthrough.with_layers(ckpt.config, layers)
    self.files = {out: ckpt.files[source] for out, source in self._names.items()}

  def header(self, name: str):
    return self._ckpt.header(self._names[name])

  def tensor(self, name: str):
    return self._ckpt.tensor(self._names[name])

  def read(self, name: str, start: int, stop: int, out=None):
    return self._ckpt.read(self._names[name], start, stop, out)


def check(slices: Slices, models: Sequence[str]) -> None:
  """Every slice gives every model one range [first, end), all of one length."""
  if not slices:
    raise UserError('config.slices: no slice to merge')
  for k, piece in enumerate(slices):
    given = sorted(piece) if isinstance(piece, Mapping) else piece
    if not isinstance(piece, Mapping) or set(piece) != set(models):
      raise UserError(f'config.slices[{k}]: give the base and each model of {list(models)} one '
                      f'layer range; got {given!r}')
    sizes = set()
    for model, span in piece.items():
      if not is_layer_range(span):
        raise UserError(f'config.slices[{k}].{model} = {span!r}: a layer range [first, end)')
      sizes.add(span[1] - span[0])
    if len(sizes) != 1:
      raise UserError(f'config.slices[{k}]: its ranges hold {sorted(sizes)} layers; every '
                      'model gives a slice as many layers')


def is_layer_range(span) -> bool:
  """Whether `span` is a [first, end) pair of integers."""
  return (isinstance(span, Sequence) and not isinstance(span, str) and len(span) == 2 and
          all(isinstance(v, int) and not isinstance(v, bool) for v in span))


def lengths(slices: Slices) -> list[int]:
  """The layers of each slice."""
  return [span[1] - span[0] for span in (next(iter(piece.values())) for piece in slices)]


def views(slices: Slices, ckpts: Mapping[str, hf.Checkpoint]) -> dict[str, View]:
  """{model: its View}, every range checked against the model's layers."""
  layers = sum(lengths(slices))
  out = {}
  for model, ckpt in ckpts.items():
    pieces = [passthrough.Slice(model, *piece[model]) for piece in slices]
    names = passthrough.sources(pieces, [ckpt] * len(pieces))
    out[model] = View(ckpt, {name: source for name, (_, source) in names.items()}, layers)
  return out


def positions(slices: Slices, names: Sequence[str]) -> dict[str, float]:
  """{output tensor: t}: j / (n_k − 1) for layer j of slice k (1 for a one-layer slice), 0
  outside the layers."""
  at = [j / (n - 1) if n > 1 else 1.0 for n in lengths(slices) for j in range(n)]
  return {name: 0.0 if layered.layer_of(name) is None else at[layered.layer_of(name)]
          for name in names}
