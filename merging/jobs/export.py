"""A merged model out to Hugging Face: the params `launch.merge` chose for one method and regime,
written as a directory that transformers loads: a CLIPVisionModelWithProjection, or for a
decoder's experiment (the text suite) a causal LM with its tokenizer, which
`launch.evaluate_checkpoint` scores.

Reads <workdir>/merge/<regime>/<method>/params (orbax) and the workdir's θ0 record for the
architecture; writes `config.export.output` through `editing.models.hf.export` (config.json,
safetensors shards with their index above `shard_bytes`, renamed into place when complete).
"""

import os

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging

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


def run(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Exports the merge of `config.export.method` in `config.export.regime`; returns the
  output directory."""
  checks.validate(config)
  settings = config.export
  if not settings.output:
    raise UserError('config.export.output is empty: name the directory to write')
  _source(config, workdir)
  theta0, _ = experiment.load_pretrained(workdir, config.model)
  model = checkpoint.load_tree(workdir_lib.pretrained_file(workdir))[1]['model']
  decoder = experiment.is_decoder(config)
  if not decoder and (model.get('family') != 'vit' or 'image_size' not in model):
    raise UserError(f'the workdir\'s θ0 ({workdir_lib.pretrained_file(workdir)}) was not '
                    'imported from CLIP weights; only imported models are exported')
  params = merged_params(config, workdir, theta0)
  if distributed.is_primary() and decoder:
    hf_decoder.export(params, DecoderConfig.from_hf(experiment.weights_of(model)),
                      settings.output, shard_bytes=settings.shard_bytes,
                      extra_files=text_data.tokenizer(config).files())
  elif distributed.is_primary():
    hf.export(settings.output, params, model, 'clip_vision', shard_bytes=settings.shard_bytes)
  distributed.sync(f'exported {settings.output}')
  logging.info('exported the %s merge (%s) to %s', settings.method, settings.regime,
               settings.output)
  return settings.output


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
