"""Merging methods: each a pure function over task vectors, in a file named after it.

Every method returns a merged `TaskVector` τ_m, applied as θ0 + λ·τ_m. `REGISTRY` maps a
method's config name to a `Method`: its `merge` function, what besides the task vectors it reads,
and whether λ is free (chosen on validation, like task arithmetic's) or the merge is applied at
λ = 1 as it is (averages, and AdaMerging and DAM, whose coefficients are learned).

Shared primitives (trim, elect sign, disjoint mean, drop and rescale) live in `merging.ops`.
"""

import functools
from typing import Callable, NamedTuple

from merging import adamerging
from merging import averaging
from merging import breadcrumbs
from merging import consensus
from merging import dam
from merging import dare
from merging import fisher
from merging import regmean
from merging import task_arithmetic
from merging import ties

INPUTS = ('key', 'theta0', 'data', 'apply_fn')


class Method(NamedTuple):
  merge: Callable
  reads: tuple[str, ...] = ()  # of INPUTS, passed as keyword arguments
  scaled: bool = True  # False: applied at λ = 1
  # The split a data-driven method reads: labeled training examples, or the unlabeled test
  # inputs that AdaMerging adapts to (its paper's test-time protocol).
  split: str = 'train'
  refused_regimes: tuple[str, ...] = ()  # regimes whose task vectors it cannot merge
  section: str | None = None  # the config section of its settings, if not its own name


REGISTRY: dict[str, Method] = {
    'averaging': Method(averaging.merge, scaled=False),
    'task_arithmetic': Method(task_arithmetic.merge),
    'ties': Method(ties.merge),
    'dare': Method(dare.merge, reads=('key',)),
    'breadcrumbs': Method(breadcrumbs.merge),
    'consensus': Method(consensus.merge),
    'fisher': Method(fisher.merge, reads=('theta0', 'data'), scaled=False),
    'regmean': Method(regmean.merge, reads=('theta0', 'apply_fn', 'data'), scaled=False,
                      refused_regimes=('linearized',)),
    'adamerging_task': Method(functools.partial(adamerging.merge, granularity='task'),
                              reads=('theta0', 'data', 'key'), scaled=False, split='test'),
    'adamerging_layer': Method(functools.partial(adamerging.merge, granularity='layer'),
                               reads=('theta0', 'data', 'key'), scaled=False, split='test'),
    'dam': Method(dam.merge, reads=('theta0', 'data', 'key'), scaled=False, split='test'),
}


def get(name: str) -> Method:
  try:
    return REGISTRY[name]
  except KeyError:
    raise ValueError(f'unknown merging method {name!r}; known: {sorted(REGISTRY)}') from None
