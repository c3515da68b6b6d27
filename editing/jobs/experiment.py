"""What every job reads from an experiment's config and workdir: the tasks, regimes and triggers
it names, their data, the mesh, the model, the pretrained backbone θ0, the frozen heads and the
evaluator, gathered once in an `Experiment`. (The check every job makes of its config before it
writes anything: `editing.jobs.checks`.)

The data is the built-in suite (`config.suite`), or, when the config has a `data` section
(configs/clip_8task.py), datasets on local disk: <config.data_root>/<name> in any layout
`editing.data.images` reads, with the control task of negation named by `config.data.control`.

A config whose `model` is a Hugging Face config.json's fields (it has a `model_type`,
configs/text_quickstart.py) is a decoder language model's on the built-in text suite
(`editing.data.text_suite`): its tasks are rows of tokens (`editing.jobs.text_data`), it has no
heads, an example is right when its whole answer is (exact match), and negation's control
is the likelihood of held-out general text (1 / its perplexity).
"""

import dataclasses
import functools
import json
import math
import os
from typing import Any, Callable, Sequence

import jax
import ml_collections

from editing import checkpoint
from editing import evaluate
from editing import regimes
from editing import sharding
from editing import tree as tree_lib
from editing.data import images
from editing import text_finetune
from editing.data import suite
from editing.data import text_suite
from editing.data import triggers
from editing.errors import UserError
from editing.jobs import text_data
from editing.jobs import workdir as workdir_lib
from editing.models import decoder
from editing.models import head as head_lib
from editing.models import hf
from editing.models import text
from editing.models.decoder_config import DecoderConfig
from editing.models import vit
from editing.models import zero_shot
from editing.task_vector import TaskVector


def names_from(value: str, *, key: str, kind: str, known: Sequence[str]) -> list[str]:
  """The comma-separated names of the config value at `key`, each one of `known`."""
  names = [n.strip() for n in value.split(',') if n.strip()]
  unknown = [n for n in names if n not in known]
  if unknown or not names:
    raise UserError(f'{key}: unknown {kind}(s) {unknown or names}; choose from '
                     f'{",".join(known)}')
  return names


def is_decoder(config: ml_collections.ConfigDict) -> bool:
  """Whether the model is a decoder language model on the text suite, not the image encoder."""
  return 'model_type' in config.model


def on_disk(config: ml_collections.ConfigDict) -> bool:
  """Whether the tasks are datasets on local disk (a `data` section) rather than the suite."""
  return 'data' in config


def tasks(config: ml_collections.ConfigDict) -> list[str]:
  """The downstream tasks named by `config.suite.tasks` (or `config.data.tasks`), validated."""
  if on_disk(config):
    return names_from(config.data.tasks, key='config.data.tasks', kind='dataset',
                      known=_datasets_on_disk(config))
  return names_from(config.suite.tasks, key='config.suite.tasks', kind='task',
                    known=_suite(config).DOWNSTREAM_TASKS)


def _suite(config: ml_collections.ConfigDict):
  """The built-in suite of the config's model: the text suite or the image one."""
  return text_suite if is_decoder(config) else suite


def control_task(config: ml_collections.ConfigDict) -> str:
  """The task negation must not harm: the suite's shapes, or `config.data.control`."""
  if is_decoder(config):
    return text_suite.HELD_OUT_TEXT
  if not on_disk(config):
    return suite.CONTROL_TASK
  if not config.data.control:
    raise UserError('config.data.control is empty: name the dataset under config.data_root '
                    'that negation must not harm (the papers use ImageNet)')
  return names_from(config.data.control, key='config.data.control', kind='dataset',
                    known=_datasets_on_disk(config))[0]


def _datasets_on_disk(config: ml_collections.ConfigDict) -> list[str]:
  root = config.data_root
  if not root or not os.path.isdir(root):
    raise UserError(f'config.data_root = {root!r} is not a directory; set --config.data_root '
                    'to the directory that holds one folder per dataset')
  return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))


def configured_regimes(config: ml_collections.ConfigDict) -> list[regimes.Regime]:
  """The regimes named by `config.regimes`, each with its settings section (e.g. config.talos)."""
  return [regime(config, r) for r in names_from(config.regimes, key='config.regimes',
                                                kind='regime', known=list(regimes.REGISTRY))]


def regime(config: ml_collections.ConfigDict, name: str) -> regimes.Regime:
  """The regime `name` with the settings of its config section, if it has one (on a decoder,
  as `text_finetune.regime` applies it)."""
  of = text_finetune.regime if is_decoder(config) else regimes.get
  return of(name, _section(config, name))


def poisoned_tasks(config: ml_collections.ConfigDict) -> list[str]:
  """The tasks `config.poison.tasks` names (none when it is empty or absent)."""
  if config.get('poison') is None or not config.poison.tasks.strip():
    return []
  return names_from(config.poison.tasks, key='config.poison.tasks', kind='task',
                    known=tasks(config) if on_disk(config) else suite.DOWNSTREAM_TASKS)


def trigger(config: ml_collections.ConfigDict, name: str) -> triggers.Trigger:
  """The trigger `name` with the settings of its config section (e.g. config.badnets)."""
  return triggers.get(name, _section(config, name))


def _section(config: ml_collections.ConfigDict, name: str) -> dict | None:
  section = config.get(name)
  return section.to_dict() if section is not None else None


def load_task(config: ml_collections.ConfigDict, name: str):
  """A task's data: a `suite.Task` of images, or a `text_finetune.TextTask` of token rows."""
  if is_decoder(config):
    return text_data.load_task(config, name)
  if on_disk(config):
    return images.load_task(config.data_root, name, val_fraction=config.data.val_fraction,
                            seed=config.data.seed,
                            preprocess=images.Preprocess(config.data.image_size))
  size = config.suite.pretrain_size if name == suite.CONTROL_TASK else config.suite.train_size
  return suite.load_task(name, seed=config.suite.seed, train_size=size,
                         test_size=config.suite.test_size, val_fraction=config.suite.val_fraction)


def data_settings(config: ml_collections.ConfigDict, *suite_fields: str) -> dict:
  """What a job's data depends on, for its record, under the config key it comes from: the
  named `config.suite` fields (every one but the task list for the text suite), or
  `config.data` and the data root."""
  if is_decoder(config):
    return {'suite': {k: v for k, v in config.suite.items() if k != 'tasks'}}
  if on_disk(config):
    return {'data': {'root': os.path.abspath(config.data_root), **config.data.to_dict()}}
  return {'suite': {name: config.suite[name] for name in ('seed', 'val_fraction', 'test_size') +
                    suite_fields}}


def finetune_settings(config: ml_collections.ConfigDict,
                      task: suite.Task) -> ml_collections.ConfigDict:
  """`config.finetune` for `task`; on disk, a task listed in `config.data.epochs` trains for
  that many epochs of its training split (the papers' budget per dataset)."""
  settings = ml_collections.ConfigDict(config.finetune.to_dict())
  epochs = config.data.epochs.get(task.name) if on_disk(config) else None
  if epochs:
    settings.steps = math.ceil(epochs * len(task.train) / settings.batch_size)
  return settings


def mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  return sharding.make_mesh(config.num_devices or None, config.sharding.fsdp,
                            config.sharding.tensor)


def sharding_rules(config: ml_collections.ConfigDict) -> list:
  """The config's (regex, spec) overrides, then the logical-axis rules of its preset."""
  return [tuple(rule) for rule in config.sharding_rules] + sharding.logical_rules(
      config.sharding.preset)


def model(config_model: ml_collections.ConfigDict | dict):
  """(the module, apply_fn(params, inputs)): the ViT encoder of images, or the decoder of
  packed token rows (`text_finetune.apply_fn`, logits)."""
  config_model = dict(config_model)
  if 'model_type' in config_model:
    decoder_config = DecoderConfig.from_hf(config_model)
    dtype = config_model.get('dtype', 'float32')
    return (decoder.Decoder(decoder_config, dtype),
            text_finetune.apply_fn(decoder_config, dtype))
  module = vit.build(ml_collections.ConfigDict(config_model))
  return module, lambda params, images: module.apply({'params': params}, images)


def weights_of(model_config: dict) -> dict:
  """A model config less its compute dtype: what decides the weights."""
  return {k: v for k, v in dict(model_config).items() if k != 'dtype'}


def load_pretrained(workdir: str, expected_model: ml_collections.ConfigDict | None = None):
  """(θ0, apply_fn) from <workdir>/pretrain/params.safetensors, built from its own metadata.

  A job passes its `config.model` as `expected_model`: a backbone of another model is refused
  before the job writes anything, and its compute dtype ('bfloat16' for mixed precision)
  replaces the recorded one. The params stay as stored, float32.
  """
  path = workdir_lib.pretrained_file(workdir)
  if not os.path.exists(path):
    raise FileNotFoundError(f'no pretrained backbone at {path}; run launch.pretrain (or '
                            'launch.quickstart) with this --workdir first')
  params, meta = checkpoint.load_tree(path)
  recorded = meta['model']
  if expected_model is not None:
    wanted = weights_of(expected_model.to_dict())
    differing = sorted(k for k in wanted.keys() | weights_of(recorded).keys()
                       if wanted.get(k) != recorded.get(k))
    if differing:
      key = differing[0]
      raise UserError(f'{path} is a backbone with model.{key} = {recorded.get(key)!r}, but '
                      f'config.model.{key} = {wanted.get(key)!r}; use the config it was made '
                      'with, or another --workdir')
    recorded = {**recorded, 'dtype': expected_model.get('dtype', 'float32')}
  _, apply_fn = model(recorded)
  return params, apply_fn


def head_settings(config: ml_collections.ConfigDict) -> dict:
  """What the frozen heads add to a job's record: their logit scale (a decoder has none)."""
  return {} if is_decoder(config) else {'logit_scale': config.head.logit_scale}


def training_record(section: ml_collections.ConfigDict) -> dict:
  """A training section for a job's record, `accumulation` left out at its default of 1 so
  that records made before it existed stay valid (it changes no result)."""
  record = section.to_dict()
  if record.get('accumulation') == 1:
    del record['accumulation']
  return record


def precision_settings(config: ml_collections.ConfigDict) -> dict:
  """The compute dtype, for a job's record when it is not float32 (records made before mixed
  precision existed stay valid)."""
  dtype = config.model.get('dtype', 'float32')
  return {} if dtype == 'float32' else {'compute_dtype': dtype}


def evaluator(config: ml_collections.ConfigDict, apply_fn, regime_name: str) -> evaluate.Evaluator:
  """The evaluator of one regime's edits; a decoder's predicts the argmax token per position."""
  encoder = regimes.get(regime_name).encoder(apply_fn)
  if is_decoder(config):
    encoder = text_finetune.predicted_tokens(encoder)
  return evaluate.Evaluator(encoder,
                            mesh=mesh(config), batch_size=config.eval.batch_size,
                            sharding_rules=sharding_rules(config))


def head(config: ml_collections.ConfigDict, workdir: str, task: suite.Task, theta0: Any,
         apply_fn) -> jax.Array | None:
  """The task's frozen head, made once and cached in the workdir: zero-shot from the text
  tower of `config.weights` when it has one, else the prototypes of θ0's embeddings. A
  decoder has none: it answers in tokens."""
  if is_decoder(config):
    return None
  path = workdir_lib.head_file(workdir, task.name)
  if not os.path.exists(path):
    if config.get('weights') and hf.clip_towers(config.weights)[1]:
      weights = zero_shot_head(config, task)
    else:
      features = evaluator(config, apply_fn, 'full').features(theta0, theta0, task.train)
      weights = head_lib.fit_prototypes(features, task.train.labels, task.num_classes)
    checkpoint.save_tree(path, {'head': weights})
  return checkpoint.load_tree(path)[0]['head']


@functools.lru_cache(maxsize=2)
def _text_tower(weights: str):
  params, model = hf.load(weights, hf.clip_towers(weights)[1])
  return params, model, text.Tokenizer(weights)


def zero_shot_head(config: ml_collections.ConfigDict, task: suite.Task):
  """The zero-shot head of `task` from the text tower of `config.weights`, its class names
  (underscores read as spaces) in the templates of `config.data` for this dataset."""
  if not task.train.classes:
    raise UserError(f'dataset {task.name!r} names no classes (an .npz has none); keep it as '
                    'class folders or a parquet export with ClassLabel names for a zero-shot head')
  templates = list(config.data.templates)
  if config.data.templates_file:
    with open(config.data.templates_file) as f:
      templates = json.load(f).get(task.name, templates)
  params, model, tokenizer = _text_tower(config.weights)
  classnames = [c.replace('_', ' ') for c in task.train.classes]
  return zero_shot.head(params, model, tokenizer, classnames, templates)


@dataclasses.dataclass(eq=False)
class Experiment:
  """One experiment as every job reads it, each part loaded once, when first used.

  θ0 is loaded (and checked against config.model) at `load`; the tasks' data, their frozen
  heads (fitted on θ0 and cached in the workdir the first time), each regime's task vectors
  and evaluator when a job first asks for them, so that a job checks what it must before any
  of them is made.

  Attributes:
    config: the experiment's config.
    workdir: its workdir.
    tasks: the downstream tasks the config names.
    theta0: the pretrained params.
    apply_fn: apply_fn(params, images) of the model.
  """

  config: ml_collections.ConfigDict
  workdir: str
  tasks: list[str]
  theta0: Any
  apply_fn: Callable

  @classmethod
  def load(cls, config: ml_collections.ConfigDict, workdir: str) -> 'Experiment':
    theta0, apply_fn = load_pretrained(workdir, config.model)
    return cls(config, workdir, tasks(config), theta0, apply_fn)

  def task(self, name: str) -> suite.Task:
    """A task's data (a downstream task or the control), loaded once."""
    if name not in self._tasks:
      self._tasks[name] = load_task(self.config, name)
    return self._tasks[name]

  def head(self, name: str) -> jax.Array:
    """A task's frozen head, made once."""
    if name not in self._heads:
      self._heads[name] = head(self.config, self.workdir, self.task(name), self.theta0,
                               self.apply_fn)
    return self._heads[name]

  def data(self, names: Sequence[str] | None = None) -> dict[str, suite.Task]:
    """{task: its data} of `names` (default: the downstream tasks)."""
    return {t: self.task(t) for t in (self.tasks if names is None else names)}

  def heads(self, names: Sequence[str] | None = None) -> dict[str, jax.Array]:
    """{task: its frozen head} of `names` (default: the downstream tasks)."""
    return {t: self.head(t) for t in (self.tasks if names is None else names)}

  @functools.cached_property
  def base(self) -> str:
    """θ0's fingerprint, which every task vector of the experiment carries as its base."""
    return tree_lib.fingerprint(self.theta0)

  def vectors(self, regime_name: str) -> dict[str, TaskVector]:
    """{task: its task vector} of one regime, each checked against θ0, loaded once."""
    if regime_name not in self._vectors:
      self._vectors[regime_name] = self._load_vectors(regime_name)
    return self._vectors[regime_name]

  def _load_vectors(self, regime_name: str) -> dict[str, TaskVector]:
    """The regime's saved task vectors. A vector must exist, be finite, match θ0's tree and
    carry θ0's fingerprint as its base: one fine-tuned from another backbone is refused,
    naming its file."""
    paths = {t: workdir_lib.task_vector_file(self.workdir, regime_name, t) for t in self.tasks}
    missing = [t for t, path in paths.items() if not os.path.exists(path)]
    if missing:
      raise FileNotFoundError(f'no {regime_name} task vector for {missing} in {self.workdir}; '
                              'run launch.finetune (or launch.quickstart) with this --workdir '
                              'and regime first')
    vectors = {}
    for task, path in paths.items():
      vector, _ = checkpoint.load_task_vector(path)
      if vector.base != self.base:
        raise UserError(f'{path} was fine-tuned from the backbone with fingerprint '
                        f'{vector.base}, but the θ0 in '
                        f'{workdir_lib.pretrained_file(self.workdir)} has {self.base}; '
                        'fine-tune again from this θ0')
      vector.check_fits(self.theta0, path)
      vectors[task] = vector
    return vectors

  def evaluator(self, regime_name: str) -> evaluate.Evaluator:
    """The evaluator of one regime's edits."""
    if regime_name not in self._evaluators:
      self._evaluators[regime_name] = evaluator(self.config, self.apply_fn, regime_name)
    return self._evaluators[regime_name]

  def __post_init__(self):
    self._tasks, self._heads, self._vectors, self._evaluators = {}, {}, {}, {}
