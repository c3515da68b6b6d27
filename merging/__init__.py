"""Merging methods: each a pure function over task vectors, in a file named after it.

Every method returns a merged `TaskVector` τ_m, applied as θ0 + λ·τ_m, or, where it keeps one
vector per task (`Method.per_task`: EMR, TALL masks), a list of them, each applied to its own
task's inputs, or, where its merge is a model of its own (`Method.forward`: WEMoE's routed
MLPs), that model. `REGISTRY` maps a method's config name to a `Method`: its `merge` function,
what besides the task vectors it reads, whether λ is free (chosen on validation, like task
arithmetic's, on 0 … `lambda_max`) or the merge is applied at λ = 1 as it is (averages, Model
Stock, WUDI, and AdaMerging and DAM, whose coefficients are learned), and what a streamed
checkpoint merge must do for it. Each method's settings are declared beside its function
(`editing.settings`), and so is what a sparsifying method keeps of each vector
(`merging.sparsity`), which the in-memory and the streamed merges both read. A method mergekit
has carries its translation (`Method.mergekit`: mergekit's names, parameters and defaults onto
ours, `merging.translation`), which the YAML reader looks up.

LoRA task vectors are merged by every method as their dense ΔW = s·B A, and as factors by the
LoRA-space methods (KnOTS, LoRM, PEFT's combinations), whose merges stay LoRA vectors.

Shared primitives (trim, elect sign, disjoint mean, drop and rescale, layers read as matrices,
the polar factor) live in `merging.ops`; LiNeS (`merging.lines`) rescales any merge by depth.
"""

import dataclasses
import functools
import inspect
from typing import Callable, Mapping, Sequence

import ml_collections
import numpy as np

from editing import regimes
from editing import registry
from editing import settings as settings_lib
from merging import adamerging
from merging import arcee_fusion
from merging import averaging
from merging import breadcrumbs
from merging import cart
from merging import consensus
from merging import dam
from merging import dare
from merging import emr
from merging import della
from merging import extract
from merging import fisher
from merging import iso_c
from merging import iso_cts
from merging import karcher
from merging import knots
from merging import localize_stitch
from merging import lorm
from merging import magmax
from merging import model_stock
from merging import multislerp
from merging import nearswap
from merging import negation
from merging import nuslerp
from merging import peft_combinations
from merging import regmean
from merging import regmean_plusplus
from merging import sce
from merging import slerp
from merging import sparsity as sparsity_lib
from merging import tall_masks
from merging import task_arithmetic
from merging import ties
from merging import tsv_m
from merging import wemoe
from merging import wudi
from merging.translation import gta
from merging.translation import Translation

# What a method may read besides the task vectors, passed as keyword arguments: a PRNG key,
# θ0, the plain model apply_fn(params, images), per-task data (`common.TaskData`), and the
# true backdoor trigger (only the oracle ablation of DAM reads it).
INPUTS = ('key', 'theta0', 'apply_fn', 'data', 'trigger')
WRITES = ('weights', 'delta')


@dataclasses.dataclass(frozen=True)
class Method:
  merge: Callable
  reads: tuple[str, ...] = ()  # of INPUTS
  scaled: bool = True  # False: applied at λ = 1
  # The top of λ's validation grid: the authors' own range where they sweep past 1 (the
  # SVD-era merges' vectors are not sums of T vectors; TIES and Breadcrumbs peak near 1).
  lambda_max: float = 1.0
  # The split a data-driven method reads: labeled training examples, or the unlabeled test
  # inputs that AdaMerging adapts to (its paper's test-time protocol).
  split: str = 'train'
  refused_regimes: tuple[str, ...] = ()  # regimes whose task vectors it cannot merge
  section: str | None = None  # the config section of its settings, if not its own name
  # What a sparsifying method keeps of each vector (`merging.sparsity`): sparsity(**settings)
  # of one vector's settings; its merge takes what a streamed merge found beforehand as `keep`
  # (the masks of its cuts) and `dropped` (the vectors after its draws).
  sparsity: Callable[..., sparsity_lib.Sparsity] | None = None
  # Whether a streamed merge must hold each tensor whole (an SVD, a cosine over it), unless
  # `sums` or `scores` says how it streams.
  whole_tensor: bool = False
  # A method that reads a tensor whole only through sums over its entries (norms, dot
  # products): sums(**settings) gives sums(theta0, deltas) of a leaf (a float32 array, None
  # where the settings need more), which a streamed merge adds over a tensor's blocks in a pass
  # before it merges them a block at a time; its merge takes the whole tensor's as `totals`.
  sums: Callable[..., Callable | None] | None = None
  # A method that keeps the entries of a tensor by a score across its vectors (SCE's
  # variances, Arcee Fusion's importances): scores(**settings) gives its `sparsity.Scores`, or
  # None where it keeps every entry; a streamed merge ranks them before its sums, which then
  # see what is kept, and its merge takes the mask as `selected` (and, with sums, the tensor's
  # entry count as `entries`).
  scores: Callable[..., sparsity_lib.Scores | None] | None = None
  # check_sums(totals, name, weights) refuses a tensor's sums that its merge cannot be made
  # from, naming the tensor: a streamed merge calls it before the blocks merge under jit.
  check_sums: Callable[[np.ndarray, str, Sequence[float] | None], None] | None = None
  # Whether an entry's merge reads only that entry of each task vector (a streamed merge may
  # then split a tensor over devices); not so for an SVD or a cosine over the tensor.
  elementwise: bool = True
  # How many task vectors it merges, where that is fixed (SLERP: one model into the base).
  vectors: int | None = None
  # The settings it may take one per vector (`per_vector=`: mergekit's per-model density).
  per_vector: tuple[str, ...] = ()
  # Whether it merges LoRA vectors as their factors; every other method merges the dense
  # ΔW = s·B A of LoRA vectors.
  low_rank: bool = False
  # Whether it perturbs the inputs in their own space (DAM's surrogate trigger, δ on pixels):
  # tokens have no such space, so a decoder's experiment refuses it.
  perturbs_inputs: bool = False
  # What a checkpoint merge writes: 'weights', θ0 + λ·τ_m in the plan's dtype; or 'delta',
  # τ_m itself in float32.
  writes: str = 'weights'
  # The mergekit merge_methods it runs, by mergekit's name (`merging.mergekit` reads them).
  mergekit: Mapping[str, Translation] = dataclasses.field(default_factory=dict)
  # Whether its merge keeps one vector per task (EMR, TALL masks), each applied to its own
  # task's inputs: the task's identity is needed at inference, and a checkpoint merge, which
  # writes one model, does not run it.
  per_task: bool = False
  # How a checkpoint merge of decoders runs it a layer at a time on calibration text
  # (merging/checkpoints/calibrated.py), where it can: each model's stream goes on through its
  # own layer ('own', RegMean) or through the merged one ('merged', RegMean++).
  streams: str | None = None
  # Where its merge is a model of its own rather than a vector (WEMoE's routed MLPs): the
  # encoder(θ0, model, inputs) that runs it, from a regime's encoder(θ0, params, inputs).
  forward: Callable | None = None

  def __post_init__(self):
    unknown = sorted(set(self.reads) - set(INPUTS))
    if unknown:
      raise ValueError(f'a merging method reads {unknown}, which are not of {INPUTS}')
    if self.writes not in WRITES:
      raise ValueError(f'a merging method writes one of {WRITES}, not {self.writes!r}')

  @property
  def data_free(self) -> bool:
    """Whether it reads nothing but the task vectors, θ0 and a key: it can stream
    checkpoints."""
    return set(self.reads) <= {'key', 'theta0'} and not self.per_task and not self.forward

  @property
  def weighted(self) -> bool:
    """Whether it takes per-vector weights, as mergekit's methods do."""
    inner = self.merge.func if isinstance(self.merge, functools.partial) else self.merge
    return 'weights' in inspect.signature(inner).parameters

  @property
  def settings(self) -> dict[str, settings_lib.Setting]:
    """The settings `merge` declares (`editing.settings`), less what a partial binds."""
    return settings_lib.of(self.merge)


_SPHERICAL = dict(reads=('theta0',), scaled=False, whole_tensor=True, elementwise=False)
_LEARNED = dict(reads=('theta0', 'data', 'key'), scaled=False, split='test')
_UPSCALED = dict(_LEARNED, forward=wemoe.encoder, refused_regimes=regimes.TANGENT)
_DAM = dict(_LEARNED, section='dam', perturbs_inputs=True)
_LOW_RANK = dict(low_rank=True, whole_tensor=True, elementwise=False)
# mergekit's defaults shared by its methods: DARE's and DELLA's L1 rescale, Breadcrumbs' band.
_L1 = {'rescale': 'l1_norm'}
_CRUMBS = dict(normalize=False, top=0.0, bottom=0.0)

REGISTRY: dict[str, Method] = {
    'averaging': Method(averaging.merge, scaled=False),
    'task_arithmetic': Method(task_arithmetic.merge, mergekit={
        'linear': Translation({'normalize': True}, ('normalize',), ('weight',), base='none'),
        'task_arithmetic': Translation({'normalize': False}, ('normalize', 'lambda'),
                                       ('weight',))}),
    'ties': Method(ties.merge, sparsity=ties.sparsity, lambda_max=2.0, per_vector=('density',),
                   mergekit={'ties': gta((), 'density', normalize=True, scope='tensor',
                                         density=1.0)}),
    'dare': Method(dare.merge, reads=('key',), sparsity=dare.sparsity,
                   per_vector=('p', 'density'), mergekit={
                       'dare_ties': gta((), 'p', then='ties', density=1.0, scope='tensor',
                                        normalize=False, p=0.0, **_L1),
                       'dare_linear': gta((), 'p', then='task_arithmetic', normalize=False,
                                          p=0.0, scope='tensor', **_L1)}),
    'breadcrumbs': Method(breadcrumbs.merge, sparsity=breadcrumbs.sparsity, lambda_max=2.0,
                          mergekit={
                              'breadcrumbs': gta(('gamma',), 'band', elect_sign=False,
                                                 **_CRUMBS),
                              'breadcrumbs_ties': gta(('gamma',), 'band', elect_sign=True,
                                                      **_CRUMBS)}),
    'consensus': Method(consensus.merge),
    'tall_masks': Method(tall_masks.merge, scaled=False, per_task=True),
    'emr': Method(emr.merge, scaled=False, per_task=True),
    # WEMoE: the MLPs upscaled over the task vectors, routed per sample by routers trained on
    # unlabeled test inputs; a model of its own, run by its forward.
    'wemoe': Method(wemoe.merge, **_UPSCALED),
    'e_wemoe': Method(wemoe.merge_efficient, **_UPSCALED),
    'magmax': Method(magmax.merge),
    # Localize-and-Stitch: each vector on its own small region, overlaps averaged.
    'dataless_localize_stitch': Method(localize_stitch.merge_dataless, scaled=False,
                                       sparsity=localize_stitch.dataless_sparsity),
    'localize_stitch': Method(localize_stitch.merge, reads=('theta0', 'data'), scaled=False),
    # The SVD-era merges: each matrix is decomposed whole.
    'tsv_m': Method(tsv_m.merge, whole_tensor=True, elementwise=False,
                     lambda_max=3.0),
    'iso_c': Method(iso_c.merge, whole_tensor=True, elementwise=False,
                     lambda_max=3.0),
    'iso_cts': Method(iso_cts.merge, whole_tensor=True, elementwise=False,
                     lambda_max=3.0),
    'wudi': Method(wudi.merge, scaled=False, whole_tensor=True, elementwise=False),
    # CART truncates each centred vector: applied as it is, its λ inside (`prior`).
    'cart': Method(cart.merge, scaled=False, whole_tensor=True, elementwise=False),
    'model_stock': Method(model_stock.merge, scaled=False, whole_tensor=True,
                          elementwise=False, sums=model_stock.streamed_sums, mergekit={
                              'model_stock': Translation({'clip': False}, ('filter_wise',))}),
    # mergekit's methods: DELLA and SCE sparsify as TIES does, the spherical interpolations
    # take the models' weights (or their task vectors) whole and are applied as they are.
    'della': Method(della.merge, reads=('key',), sparsity=della.sparsity, elementwise=False,
                    lambda_max=3.0, per_vector=('density', 'epsilon'), mergekit={
                        'della': gta(('epsilon',), 'density', elect_sign=True, normalize=True,
                                     density=1.0, epsilon=0.15, **_L1),
                        'della_linear': gta(('epsilon',), 'density', elect_sign=False,
                                            normalize=False, density=1.0, epsilon=0.15,
                                            **_L1)}),
    'sce': Method(sce.merge, whole_tensor=True, elementwise=False, lambda_max=3.0,
                  sums=sce.streamed_sums, scores=sce.selection, mergekit={'sce': Translation({'select_topk': 1.0},
                                               ('select_topk', 'int8_mask'))}),
    'slerp': Method(slerp.merge, vectors=1, sums=slerp.streamed_sums, **_SPHERICAL,
                    mergekit={'slerp': Translation({}, ('t',), required=('t',))}),
    'nuslerp': Method(nuslerp.merge, vectors=2, sums=nuslerp.streamed_sums, **_SPHERICAL,
                      mergekit={'nuslerp': Translation(
                          {'flatten': True, 'row_wise': False},
                          ('nuslerp_flatten', 'nuslerp_row_wise'), ('weight',),
                          base='optional')}),
    'multislerp': Method(multislerp.merge, sums=multislerp.streamed_sums,
                         check_sums=multislerp.check_sums, **_SPHERICAL, mergekit={
        'multislerp': Translation({}, ('normalize_weights',), ('weight',), base='optional')}),
    'karcher': Method(karcher.merge, sums=karcher.streamed_sums, **_SPHERICAL, mergekit={
        'karcher': Translation({'max_iter': 10, 'tol': 1e-5, 'task_space': False},
                               ('max_iter', 'tol'), base='averaged')}),
    'nearswap': Method(nearswap.merge, vectors=1, scaled=False,
                       mergekit={'nearswap': Translation({}, ('t',), required=('t',))}),
    # One fine-tuned model's vector negated (θ0 − λ·τ_1), or written as it is (τ_1).
    'negation': Method(negation.merge, vectors=1),
    'extract': Method(extract.merge, vectors=1, scaled=False, writes='delta'),
    'arcee_fusion': Method(arcee_fusion.merge, vectors=1, reads=('theta0',), scaled=False,
                           whole_tensor=True, elementwise=False,
                           scores=arcee_fusion.selection,
                           mergekit={'arcee_fusion': Translation({})}),
    # LoRA-space merges: KnOTS aligns the adapters by one SVD per kernel (its merge is a
    # disjoint mean, like TIES', and chose λ at the top of a grid to 2); PEFT's
    # add_weighted_adapter combines their factors (merging/peft_combinations.py).
    'knots_ties': Method(knots.merge_ties, lambda_max=3.0, **_LOW_RANK),
    'knots_dare': Method(knots.merge_dare, reads=('key',), lambda_max=3.0, **_LOW_RANK),
    **{f'peft_{c}': Method(peft_combinations.of(c), reads=('key',), section='peft', **_LOW_RANK)
       for c in peft_combinations.COMBINATIONS},
    # LoRM fits one adapter to every task's layer inputs, as RegMean fits dense layers.
    'lorm': Method(lorm.merge, reads=('theta0', 'apply_fn', 'data'), scaled=False,
                   refused_regimes=regimes.TANGENT, **_LOW_RANK),
    'fisher': Method(fisher.merge, reads=('theta0', 'data'), scaled=False),
    'regmean': Method(regmean.merge, reads=('theta0', 'apply_fn', 'data'), scaled=False,
                      refused_regimes=regimes.TANGENT, streams='own'),
    'regmean_plusplus': Method(regmean_plusplus.merge, reads=('theta0', 'apply_fn', 'data'),
                               scaled=False, refused_regimes=regimes.TANGENT, streams='merged'),
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


# The config sections of the methods' settings (DAM's ablations read config.dam).
SECTIONS = tuple(sorted({m.section or name for name, m in REGISTRY.items()}))


def get(name: str) -> Method:
  return registry.lookup(REGISTRY, name, 'merging method')


def _reading(section: str) -> Method:
  """The method `section` names, or one whose settings are config.<section> (all that read a
  shared section declare the same settings)."""
  if section in REGISTRY:
    return REGISTRY[section]
  return next(m for name, m in REGISTRY.items() if (m.section or name) == section)


def defaults(section: str) -> ml_collections.ConfigDict:
  """A method's config section, or one of SECTIONS: each setting at its declared default."""
  return settings_lib.defaults(_reading(section).merge)


def sweep_axes(section: str) -> ml_collections.ConfigDict:
  """A section of `config.sweep`: no axis until a tuple is given for one."""
  return settings_lib.sweep_axes(_reading(section).merge)


def check_settings(name: str, given, where: str) -> dict:
  """Every setting of method `name`, `given` checked (errors name `where`.<setting>)."""
  return settings_lib.check(get(name).merge, given, where)
