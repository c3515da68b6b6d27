"""mergekit-moe's YAML, read into an `MoeRecipe` and checked as mergekit-moe checks it.

  base_model: /models/base                 # donates attention, norms, embeddings, the head
  gate_mode: hidden                        # hidden | hidden_avg | hidden_last | cheap_embed |
                                           # random | uniform_random
  dtype: bfloat16                          # of the output; default: the base's
  experts_per_token: 2
  experts:
    - source_model: /models/math           # its MLP is one expert of every layer
      positive_prompts: ["Solve for x"]
      negative_prompts: ["Write a poem"]   # optional
      noise_scale: 0.01                    # optional: + N(0, s²) on its MLP weights
      residual_scale: 0.5                  # optional: × s on its down projection

  shared_experts:                          # optional: one, making a Qwen2-MoE
    - source_model: /models/general        # its MLP every token takes, gated by sigmoid

The output is a Mixtral from Llama or Mistral models, a Qwen3-MoE from Qwen3 models, or, with
a shared expert, a Qwen2-MoE from Llama, Mistral or Qwen2 ones, as mergekit-moe chooses by the
inputs (`architecture: Mixtral`, `Qwen MoE` or `Qwen3 MoE`, mergekit's names, may say which),
written by `merging.checkpoints.upscaling`. Refused by name, as mergekit refuses them: fewer
experts than experts_per_token, an expert (or the shared one, but for gate_mode random)
without positive prompts in a prompted gate mode, the same prompts for every expert, and,
where the routers are set from prompts, the same source model for every expert (mergekit's
--i-understand-this-is-not-useful-without-training has no counterpart: such a model is one MLP
repeated). Refused here, since editmerge writes no other MoE architecture: more than one shared
expert (DeepSeek-MoE) and another `architecture`.
"""

import dataclasses

from editing.errors import UserError
from merging.checkpoints.plan import OUTPUT_DTYPES
from merging.mergekit import reader

# mergekit-moe's output architectures that editmerge writes, by their names without spaces.
ARCHITECTURES = {'mixtral': 'mixtral', 'qwenmoe': 'qwen2_moe', 'qwen3moe': 'qwen3_moe'}
GATE_MODES = ('hidden', 'hidden_avg', 'hidden_last', 'cheap_embed', 'random', 'uniform_random')
UNPROMPTED = ('random', 'uniform_random')
_TOP_KEYS = ('base_model', 'experts', 'gate_mode', 'dtype', 'experts_per_token',
             'shared_experts', 'architecture')
_EXPERT_KEYS = ('source_model', 'positive_prompts', 'negative_prompts', 'noise_scale',
                'residual_scale')


@dataclasses.dataclass(frozen=True)
class Expert:
  """One source model's MLPs, and the prompts its routers are set from."""

  source_model: str
  positive_prompts: tuple[str, ...] = ()
  negative_prompts: tuple[str, ...] = ()
  noise_scale: float | None = None
  residual_scale: float | None = None


@dataclasses.dataclass(frozen=True)
class MoeRecipe:
  """A mergekit-moe config: which models, how the routers are set, the output's dtype."""

  base_model: str
  experts: tuple[Expert, ...]
  gate_mode: str = 'hidden'
  dtype: str | None = None
  experts_per_token: int = 2
  architecture: str | None = None  # 'mixtral', 'qwen2_moe' or 'qwen3_moe' where named
  text: str = ''  # the YAML as written, for the output's card
  shared_experts: tuple[Expert, ...] = ()  # Qwen2-MoE's one, which every token takes


def read(path: str) -> MoeRecipe:
  """The mergekit-moe config at `path`, every key and value checked; the models must exist."""
  doc, text = reader.load_yaml(path, _TOP_KEYS)
  architecture = doc.get('architecture')
  if architecture is not None:
    architecture = ARCHITECTURES.get(str(architecture).lower().replace(' ', '').replace('-', ''))
    if architecture is None:
      raise UserError(f'{path}: architecture = {doc["architecture"]!r}: editmerge writes '
                      'Mixtral, Qwen MoE (Qwen2-MoE) or Qwen3 MoE')
  gate_mode = doc.get('gate_mode', 'hidden')
  if gate_mode not in GATE_MODES:
    raise UserError(f'{path}: gate_mode = {gate_mode!r}; choose one of {", ".join(GATE_MODES)}')
  shared = doc.get('shared_experts') or []
  if not isinstance(shared, list) or len(shared) > 1:
    listed = len(shared) if isinstance(shared, list) else repr(shared)
    raise UserError(f'{path}: shared_experts lists {listed}; a Qwen2-MoE takes exactly one '
                    '(DeepSeek-MoE\'s several are not written)')
  # mergekit-moe asks the shared expert for prompts in every gate mode but 'random'.
  shared = tuple(_expert(entry, k, path, 'random' if gate_mode == 'random' else 'hidden',
                         'shared_experts') for k, entry in enumerate(shared))
  if shared and architecture not in (None, 'qwen2_moe'):
    raise UserError(f'{path}: shared_experts make a Qwen2-MoE, not a {doc["architecture"]}')
  reader.check_exists(doc.get('base_model'), path, 'base_model')
  entries = doc.get('experts')
  if not isinstance(entries, list) or not entries:
    raise UserError(f'{path}: experts must list one or more source models')
  experts = tuple(_expert(entry, k, path, gate_mode) for k, entry in enumerate(entries))
  per_token = doc.get('experts_per_token', 2)
  if isinstance(per_token, bool) or not isinstance(per_token, int) or per_token < 1:
    raise UserError(f'{path}: experts_per_token = {per_token!r} must be an integer ≥ 1')
  if per_token > len(experts):
    raise UserError(f'{path}: experts_per_token = {per_token} but only {len(experts)} '
                    f'expert{"s" if len(experts) > 1 else ""}; list at least as many')
  # mergekit checks the prompts and the sources only where routers are set from prompts.
  if len(experts) > 1 and gate_mode not in UNPROMPTED:
    if len({(e.positive_prompts, e.negative_prompts) for e in experts}) == 1:
      raise UserError(f'{path}: every expert has the same prompts, so every router would route '
                      'alike; give each expert prompts of what it should take')
    if len({e.source_model for e in experts}) == 1:
      raise UserError(f'{path}: every expert is {experts[0].source_model}: the model would be '
                      'its MLP repeated, computing what one dense MLP does')
  dtype = doc.get('dtype')
  if dtype is not None and dtype not in OUTPUT_DTYPES:
    raise UserError(f'{path}: dtype = {dtype!r}; choose one of {", ".join(OUTPUT_DTYPES)}')
  return MoeRecipe(doc['base_model'], experts, gate_mode, dtype, per_token,
                   'qwen2_moe' if shared else architecture, text, shared)


def _expert(entry, k: int, path: str, gate_mode: str, key: str = 'experts') -> Expert:
  where = f'{key}[{k}]'
  reader.check_keys(entry, _EXPERT_KEYS, path, f'{where}.')
  reader.check_exists(entry.get('source_model'), path, f'{where}.source_model')
  prompts = {}
  for key in ('positive_prompts', 'negative_prompts'):
    given = entry.get(key) or []
    if not isinstance(given, list) or not all(isinstance(p, str) for p in given):
      raise UserError(f'{path}: {where}.{key} must be a list of strings')
    prompts[key] = tuple(given)
  if gate_mode not in UNPROMPTED and not prompts['positive_prompts']:
    raise UserError(f'{path}: {where}.positive_prompts is empty; gate_mode {gate_mode} '
                    'sets each router from its expert\'s prompts')
  scales = {}
  for key in ('noise_scale', 'residual_scale'):
    value = entry.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
      raise UserError(f'{path}: {where}.{key} = {value!r} must be a number')
    scales[key] = None if value is None else float(value)
  return Expert(entry['source_model'], **prompts, **scales)
