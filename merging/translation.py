"""How a mergekit method maps onto a method of `merging`: the data a registry entry holds as
`Method.mergekit` ({mergekit's name: Translation}), with mergekit's own defaults for it
(generalized_task_arithmetic.py, registry.py and each method's file, as mergekit 0.1.5 has
them). `merging.mergekit` reads it; this module imports nothing of `merging`, so that the
registry can hold it without an import cycle.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Translation:
  """How one mergekit method maps onto the method of `merging` whose entry holds it.

  Attributes:
    settings: its settings at mergekit's defaults for this method.
    parameters: the global parameters mergekit reads for it (`lambda` is the recipe's scale).
    model_parameters: the per-model ones (`weight` is the recipe's weights; the others differ
      between models only where the method takes them per vector).
    base: 'required' (task vectors against base_model), 'optional' (the task vectors given a
      base_model, else the models' weights: task_space), 'averaged' (the base is one of the
      models averaged, as mergekit's Karcher mean takes every model it is given), or 'none'
      (the models listed are merged, base_model unread: `linear`).
    required: the parameters mergekit requires.
    density_as: where mergekit's density d goes: 'density' (our density, the share kept), 'p'
      (DARE's drop probability 1 − d), 'band' (Breadcrumbs' top and bottom, of d and gamma
      together) or None (the method has none).
  """

  settings: dict
  parameters: tuple[str, ...] = ()
  model_parameters: tuple[str, ...] = ()
  base: str = 'required'
  required: tuple[str, ...] = ()
  density_as: str | None = None


def gta(sparsifier: tuple[str, ...], density_as: str, **settings) -> Translation:
  """A sparsifying method of mergekit's generalized task arithmetic (normalize, rescale and
  lambda global; weight, density and the sparsifier's own per model)."""
  return Translation(settings, ('normalize', 'rescale', 'lambda', 'int8_mask'),
                     ('weight', 'density') + sparsifier, density_as=density_as)
