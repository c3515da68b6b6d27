"""The backbone θ0: imported from real weights, the suite's shipped one, or pretrained with a
cosine head learned jointly and then discarded.

With `config.weights`, θ0 is imported once into the workdir: a CLIP directory's image tower
(Hugging Face's or open_clip's), or, for a decoder, a Hugging Face causal LM directory or a
GGUF file. Otherwise θ0 is the suite's: by default the backbone the project ships (`SHIPPED`,
a safetensors file beside its record: sha256, model, pretraining settings, the command that
regenerates it), copied into the workdir after its hash and settings are checked against the
config. `config.pretrain.from_scratch` pretrains instead, on
`config.pretrain.corpus`:
- 'captions': every word of a captioned scene (`editing.data.captions`): broad attributes at a
  coarser grain than the downstream tasks, a multi-label sigmoid per word;
- 'shapes': the control task alone, an 8-way softmax;
- 'mixture', for a decoder: the text suite's pretraining mixture
  (`text_suite.pretraining_mixture`, every task at easier spans and general text), as language
  modelling of every token.
"""

import hashlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from editing import atomic
from editing import checkpoint
from editing import regimes
from editing import settings
from editing import sharding
from editing import text_finetune
from editing import train
from editing import tree as tree_lib
from editing.data import captions
from editing.data import suite
from editing.data import text_suite
from editing.errors import UserError
from editing.jobs import checks
from editing.jobs import experiment
from editing.jobs import finetune
from editing.jobs import text_data
from editing.jobs import workdir as workdir_lib
from editing.models import head as head_lib
from editing.models import hf

CORPORA = ('captions', 'shapes', 'mixture')
_DECODER_CORPORA = ('mixture',)
# config.pretrain: a training section (`finetune.TRAINING`) and the corpus it pretrains on.
PRETRAIN = dict(
    finetune.TRAINING,
    corpus=settings.choice('captions', CORPORA, 'what θ0 is pretrained on'),
    corpus_size=settings.integer(200_000, '[1, inf)', 'captioned scenes of the captions corpus, '
                                                      'or documents of the text mixture'),
    logit_scale=settings.number(10.0, '(0, inf)', 'the jointly learned head\'s logit scale'),
    from_scratch=settings.flag(False, 'pretrain with the settings given instead of using the '
                                      'shipped backbone'))
SECTIONS = {'pretrain': PRETRAIN}
_BACKBONES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'data',
                          'backbone')
SHIPPED = os.path.join(_BACKBONES, 'vit_captions.json')
SHIPPED_DECODER = os.path.join(_BACKBONES, 'decoder_mixture.json')
# Settings that change how a run is logged or laid out in memory (microbatches of the same
# batch), not the weights it produces.
_BOOKKEEPING = ('checkpoint_every', 'log_every', 'from_scratch', 'accumulation')


def shipped_backbone(config: ml_collections.ConfigDict) -> str:
  """The path of the shipped backbone file, once its bytes match the recorded sha256 and its
  recorded model and pretraining settings match `config`'s."""
  shipped = SHIPPED_DECODER if experiment.is_decoder(config) else SHIPPED
  with open(shipped) as f:
    record = json.load(f)
  path = os.path.join(os.path.dirname(shipped), record['file'])
  # The compute dtype is not the weights': a float32 backbone serves bf16 compute too.
  wanted = {'model': experiment.weights_of(config.model.to_dict()),
            'pretrain': {k: v for k, v in config.pretrain.to_dict().items()
                         if k not in _BOOKKEEPING}}
  record = dict(record, model=experiment.weights_of(record['model']))
  differences = [f'config.{section}.{key} = {wanted[section].get(key)!r} '
                 f'(shipped: {record[section].get(key)!r})'
                 for section in wanted
                 for key in sorted(wanted[section].keys() | record[section].keys())
                 if wanted[section].get(key) != record[section].get(key)]
  if differences:
    raise UserError(f'the shipped backbone {path} was pretrained with other settings: '
                    f'{"; ".join(differences)}. Set --config.pretrain.from_scratch=true to '
                    'pretrain with these settings')
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  if digest.hexdigest() != record['sha256']:
    raise UserError(f'{path} has sha256 {digest.hexdigest()}, not the recorded '
                    f'{record["sha256"]}: the file is damaged or was replaced. Restore it from '
                    f'the repository, or regenerate it with: {record["regenerate"]}')
  return path


def import_weights(config: ml_collections.ConfigDict, out: str) -> None:
  """θ0 from `config.weights`, written to `out` once its architecture is the one
  `config.model` describes: for a decoder, a Hugging Face causal LM directory or a GGUF file
  (`text_data.load_weights`); otherwise the image tower of a CLIP checkpoint (Hugging Face's
  layout or open_clip's)."""
  wanted = config.model.to_dict()
  if experiment.is_decoder(config):
    params, model = text_data.load_weights(config.weights)
    # The compute dtype is the config's to choose; the file's is how it stores its weights.
    model, wanted = experiment.weights_of(model), experiment.weights_of(wanted)
  else:
    params, model = hf.load(config.weights, hf.clip_towers(config.weights)[0],
                            dtype=config.model.dtype)
  differences = [f'config.model.{key} = {wanted.get(key)!r} (checkpoint: {model.get(key)!r})'
                 for key in sorted(wanted.keys() | model.keys())
                 if _plain(wanted.get(key)) != _plain(model.get(key))]
  if differences:
    raise UserError(f'{config.weights} is not the model the config describes: '
                    f'{"; ".join(differences)}; choose the config variant of these weights')
  checkpoint.save_tree(out, params, {'model': config.model.to_dict()})
  logging.info('imported θ0 from %s to %s', config.weights, out)


def _plain(value):
  """Lists and tuples compare as lists (a config holds tuples, JSON gives lists)."""
  return list(value) if isinstance(value, (list, tuple)) else value


def run(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes <workdir>/pretrain/params.safetensors unless it is there: θ0 imported from
  `config.weights`, the shipped backbone, or encoder + head trained from scratch."""
  checks.validate(config, SECTIONS)
  if not config.get('weights'):
    _check_corpus(config)
  out = workdir_lib.pretrained_file(workdir)
  directory = workdir_lib.pretrain_dir(workdir)
  sections = {'model': config.model.to_dict()}
  if config.get('weights'):
    sections['weights'] = os.path.abspath(config.weights)
  else:
    sections['pretrain'] = experiment.training_record(config.pretrain)
    if config.pretrain.corpus == 'shapes':
      # The captions corpus is drawn from the pretraining seed alone: one backbone serves
      # every suite seed.
      sections.update(experiment.data_settings(config, 'pretrain_size'))
  os.makedirs(directory, exist_ok=True)
  workdir_lib.use_compilation_cache(workdir)
  workdir_lib.check_job_config(directory, sections)
  if os.path.exists(out):
    recorded = checkpoint.load_tree(out)[1].get('model')
    if experiment.weights_of(recorded or {}) != experiment.weights_of(config.model.to_dict()):
      raise UserError(f'{out} holds a backbone of model {recorded}, not config.model '
                      f'{config.model.to_dict()}; use another --workdir')
    logging.info('pretrained backbone found at %s', out)
    return
  if config.get('weights'):
    import_weights(config, out)
    return
  if not config.pretrain.from_scratch:
    shipped = shipped_backbone(config)
    with atomic.file(out) as f, open(shipped, 'rb') as source:
      shutil.copyfileobj(source, f)
    logging.info('copied the shipped backbone %s to %s', shipped, out)
    return
  if experiment.is_decoder(config):
    params = _pretrain_decoder(config, directory)
  else:
    params = _pretrain_encoder(config, directory)
  checkpoint.save_tree(out, params, {'model': config.model.to_dict()})
  logging.info('saved the pretrained backbone to %s', out)


def _check_corpus(config: ml_collections.ConfigDict) -> None:
  """A decoder pretrains on text, an image encoder on images."""
  if experiment.is_decoder(config) != (config.pretrain.corpus in _DECODER_CORPORA):
    model = 'a decoder' if experiment.is_decoder(config) else 'an image encoder'
    fitting = [c for c in CORPORA if (c in _DECODER_CORPORA) == experiment.is_decoder(config)]
    raise UserError(f'config.pretrain.corpus = {config.pretrain.corpus!r} is not a corpus for '
                    f'{model} (config.model); choose {" or ".join(map(repr, fitting))}')


def _pretrain_decoder(config: ml_collections.ConfigDict, directory: str):
  """The decoder trained from scratch on the text suite's pretraining mixture, every token
  after BOS scored. The mixture is drawn from the pretraining seed alone (its cipher key
  too): one backbone serves every suite seed."""
  module, apply_fn = experiment.model(config.model)
  texts = text_suite.pretraining_mixture(config.pretrain.seed, config.pretrain.corpus_size)
  data = text_finetune.documents(text_data.tokenizer(config), texts, config.suite.length)
  params = sharding.init_sharded(
      lambda key, inputs: module.init(key, inputs[:, text_finetune.TOKENS],
                                      inputs[:, text_finetune.POSITIONS],
                                      inputs[:, text_finetune.MASK].astype(bool)),
      experiment.mesh(config), experiment.sharding_rules(config),
      jax.random.PRNGKey(config.pretrain.seed), data.packed([0]))['params']
  loss_fn = text_finetune.loss_fn(regimes.FULL.training_encoder(apply_fn))
  trainable = {path: True for path in tree_lib.flatten(params)}
  return train.train(config.pretrain, loss_fn=loss_fn, params=params, trainable=trainable,
                     consts={'theta0': None}, data=data, workdir=directory,
                     mesh=experiment.mesh(config),
                     sharding_rules=experiment.sharding_rules(config))


def _pretrain_encoder(config: ml_collections.ConfigDict, directory: str):
  """The image encoder trained from scratch with a cosine head, which is then discarded."""
  module, apply_fn = experiment.model(config.model)
  scale = config.pretrain.logit_scale
  if config.pretrain.corpus == 'captions':
    data = captions.load_corpus(config.pretrain.seed, config.pretrain.corpus_size)
    num_outputs = len(captions.VOCABULARY)
    # A per-word bias: most words are absent from most captions.
    loss_fn = head_lib.multilabel_loss(lambda params, consts, images: head_lib.logits(
        apply_fn(params['encoder'], images), params['head'], scale) + params['bias'])
  else:
    task = experiment.load_task(config, suite.CONTROL_TASK)
    data, num_outputs = task.train, task.num_classes
    loss_fn = head_lib.cross_entropy_loss(lambda params, consts, images: head_lib.logits(
        apply_fn(params['encoder'], images), params['head'], scale))
  key_encoder, key_head = jax.random.split(jax.random.PRNGKey(config.pretrain.seed))
  encoder = sharding.init_sharded(module.init, experiment.mesh(config),
                                  experiment.sharding_rules(config), key_encoder,
                                  data.batch([0])[0])['params']
  params = {'encoder': encoder,
            'head': jax.random.normal(key_head, (num_outputs, config.model.embed_dim))}
  if config.pretrain.corpus == 'captions':
    params['bias'] = jnp.zeros((num_outputs,))
  trainable = {path: True for path in tree_lib.flatten(params)}
  trained = train.train(config.pretrain, loss_fn=loss_fn, params=params, trainable=trainable,
                        consts={}, data=data, workdir=directory,
                        mesh=experiment.mesh(config),
                        sharding_rules=experiment.sharding_rules(config))
  return trained['encoder']
