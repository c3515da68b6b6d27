"""Merging methods: each a pure function over task vectors, in a file named after it.

Every method returns a merged `TaskVector` τ_m, applied as θ0 + λ·τ_m. `REGISTRY` maps a
method's config name to a `Method`: its `merge` function, what besides the task vectors it reads,
and whether λ is free (chosen on validation, like task arithmetic's) or the merge is applied at
λ = 1 as it is (averages, and AdaMerging and DAM, whose coefficients are learned).

Shared primitives (trim, elect sign, disjoint mean, drop and rescale) live in `merging.ops`.
"""

import dataclasses
import functools
import inspect
from typing import Callable

from editing import registry
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

# What a method may read besides the task vectors, passed as keyword arguments: a PRNG key,
# θ0, the plain model apply_fn(params, images), per-task data (`common.TaskData`), and the
# true backdoor trigger (only the oracle ablation of DAM reads it).
INPUTS = ('key', 'theta0', 'apply_fn', 'data', 'trigger')


@dataclasses.dataclass(frozen=True)
class Method:
  merge: Callable
  reads: tuple[str, ...] = ()  # of INPUTS
  scaled: bool = True  # False: applied at λ = 1
  # The split a data-driven method reads: labeled training examples, or the unlabeled test
  # inputs that AdaMerging adapts to (its paper's test-time protocol).
  split: str = 'train'
  refused_regimes: tuple[str, ...] = ()  # regimes whose task vectors it cannot merge
  section: str | None = None  # the config section of its settings, if not its own name
  # The function whose keyword parameters are the settings, if `merge` forwards **settings.
  settings_of: Callable | None = None

  def __post_init__(self):
    unknown = sorted(set(self.reads) - set(INPUTS))
    if unknown:
      raise ValueError(f'a merging method reads {unknown}, which are not of {INPUTS}')

  def settings(self) -> dict[str, inspect.Parameter]:
    """The keyword settings a config section may give: `merge`'s keyword-only parameters
    (or those of `settings_of`), less the inputs and what a partial already binds."""
    bound = self.merge.keywords if isinstance(self.merge, functools.partial) else {}
    parameters = inspect.signature(self.settings_of or self.merge).parameters
    return {name: p for name, p in parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in INPUTS + tuple(bound)}


_LEARNED = dict(reads=('theta0', 'data', 'key'), scaled=False, split='test')
_DAM = dict(_LEARNED, section='dam', settings_of=dam.learn)

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
                              **_LEARNED),
    'adamerging_layer': Method(functools.partial(adamerging.merge, granularity='layer'),
                               **_LEARNED),
    'dam': Method(dam.merge, **_DAM),
    # DAM's ablations, with DAM's settings: each mask alone (the other all ones), and both
    # masks learned against the true trigger instead of a synthesised one.
    'dam_shared': Method(functools.partial(dam.merge, masks=('shared',)), **_DAM),
    'dam_safe': Method(functools.partial(dam.merge, masks=('safe',)), **_DAM),
    'dam_oracle': Method(dam.merge, **dict(_DAM, reads=_DAM['reads'] + ('trigger',))),
}


def get(name: str) -> Method:
  return registry.lookup(REGISTRY, name, 'merging method')
