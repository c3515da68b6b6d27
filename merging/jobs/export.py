"""A merged model out to Hugging Face: the params `launch.merge` chose for one method and regime,
written as a directory that transformers loads: a CLIPVisionModelWithProjection, or for a
decoder's experiment (the text suite) a causal LM with its tokenizer, which
`launch.evaluate_checkpoint` and `launch.merge_checkpoints` read. With `config.export.task`,
the model exported is instead one task's fine-tune, θ0 + τ_task of the regime, or θ0 itself
('pretrained').

Reads <workdir>/merge/<regime>/<method>/params (orbax), or the task vector, and the workdir's
θ0 record for the architecture; writes `config.export.output` through
`editing.models.hf.export` (config.json, safetensors shards with their index above
`shard_bytes`, renamed into place when complete). With `config.export.answers`, a directory,
a text experiment's tasks are written there too, for the checkpoint jobs to read:
test.jsonl, each test example as {"task", "prompt", "answer"} (launch.evaluate_checkpoint's
exact match), and train.jsonl, each training example as {"task", "text"}, its prompt and
answer (a merge's calibration text).
"""

import json
import os

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging

import merging
from editing import atomic
from editing import checkpoint
from editing import distributed
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import experiment
from editing.jobs import text_data
from editing.jobs import workdir as workdir_lib
from editing.models import hf
from editing.models.decoder_config import DecoderConfig
from third_party import hf_decoder

PRETRAINED = 'pretrained'  # config.export.task's name for θ0 itself


def run(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Exports the merge of `config.export.method` in `config.export.regime` (or the model
  `config.export.task` names); returns the output directory."""
  checks.validate(config)
  settings = config.export
  if not settings.output:
    raise UserError('config.export.output is empty: name the directory to write')
  task = settings.get('task', '')
  if task and task != PRETRAINED and task not in experiment.tasks(config):
    raise UserError(f'config.export.task = {task!r} is not a task of this experiment; choose '
                    f'one of {",".join(experiment.tasks(config))}, or {PRETRAINED!r} for θ0')
  if not task:
    method = settings.method.split('+')[0]
    if method in merging.REGISTRY and merging.get(method).per_task:
      raise UserError(f'config.export.method = {settings.method} keeps a model per task; export '
                      'a task\'s fine-tune with config.export.task, or a merge into one model')
    _source(config, workdir)
  theta0, _ = experiment.load_pretrained(workdir, config.model)
  model = checkpoint.load_tree(workdir_lib.pretrained_file(workdir))[1]['model']
  decoder = experiment.is_decoder(config)
  if not decoder and (model.get('family') != 'vit' or 'image_size' not in model):
    raise UserError(f'the workdir\'s θ0 ({workdir_lib.pretrained_file(workdir)}) was not '
                    'imported from CLIP weights; only imported models are exported')
  if task == PRETRAINED:
    params = distributed.to_host(theta0)
  elif task:
    vector = experiment.Experiment.load(config, workdir).vectors(settings.regime)[task]
    params = distributed.to_host(vector.apply_to(theta0))
  else:
    params = merged_params(config, workdir, theta0)
  if settings.get('answers') and distributed.is_primary():
    if not decoder:
      raise UserError('config.export.answers: the tasks are written for a text experiment')
    write_answers(config, settings.answers)
  if distributed.is_primary() and decoder:
    hf_decoder.export(params, DecoderConfig.from_hf(experiment.weights_of(model)),
                      settings.output, shard_bytes=settings.shard_bytes,
                      extra_files=text_data.tokenizer(config).files())
  elif distributed.is_primary():
    hf.export(settings.output, params, model, 'clip_vision', shard_bytes=settings.shard_bytes)
  distributed.sync(f'exported {settings.output}')
  logging.info('exported %s (%s) to %s', f'the {task} model' if task else
               f'the {settings.method} merge', settings.regime, settings.output)
  return settings.output


def write_answers(config: ml_collections.ConfigDict, directory: str) -> None:
  """The experiment's text tasks as test.jsonl ({"task", "prompt", "answer"} per test
  example) and train.jsonl ({"task", "text"} per training example) in `directory`."""
  os.makedirs(directory, exist_ok=True)
  test, train = [], []
  for name in experiment.tasks(config):
    task = text_data.suite_task(config, name)
    test += [{'task': name, 'prompt': p, 'answer': a} for p, a in task.test]
    train += [{'task': name, 'text': p + a} for p, a in task.train]
  for name, records in (('test.jsonl', test), ('train.jsonl', train)):
    atomic.write_bytes(os.path.join(directory, name),
                       ''.join(json.dumps(r) + '\n' for r in records).encode())


def merged_params(config: ml_collections.ConfigDict, workdir: str, theta0):
  """The params `launch.merge` saved for `config.export`'s method and regime, on the host."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, theta0)
  with ocp.StandardCheckpointer() as checkpointer:
    params = checkpointer.restore(os.path.abspath(_source(config, workdir)), abstract)
  return distributed.to_host(params)


def _source(config: ml_collections.ConfigDict, workdir: str) -> str:
  settings = config.export
  source = os.path.join(workdir_lib.merge_dir(workdir, settings.regime), settings.method,
                        'params')
  if not os.path.isdir(source):
    raise FileNotFoundError(f'no merged params at {source}; run launch.merge with '
                            f'--config.regimes={settings.regime} and method {settings.method} '
                            'first')
  return source
