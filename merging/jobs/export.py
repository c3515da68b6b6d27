"""A merged model out to Hugging Face: the params `launch.merge` chose for one method and regime,
written as a CLIPVisionModelWithProjection directory that transformers loads.

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
from editing.jobs import workdir as workdir_lib
from editing.models import hf


def run(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Exports the merge of `config.export.method` in `config.export.regime`; returns the
  output directory."""
  checks.validate(config)
  settings = config.export
  if not settings.output:
    raise UserError('config.export.output is empty: name the directory to write')
  source = os.path.join(workdir_lib.merge_dir(workdir, settings.regime), settings.method,
                        'params')
  if not os.path.isdir(source):
    raise FileNotFoundError(f'no merged params at {source}; run launch.merge with '
                            f'--config.regimes={settings.regime} and method {settings.method} '
                            'first')
  theta0, _ = experiment.load_pretrained(workdir, config.model)
  model = checkpoint.load_tree(workdir_lib.pretrained_file(workdir))[1]['model']
  if model.get('family') != 'vit' or 'image_size' not in model:
    raise UserError(f'the workdir\'s θ0 ({workdir_lib.pretrained_file(workdir)}) was not '
                    'imported from CLIP weights; only imported models are exported')
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, theta0)
  with ocp.StandardCheckpointer() as checkpointer:
    params = checkpointer.restore(os.path.abspath(source), abstract)
  params = distributed.to_host(params)
  if distributed.is_primary():
    hf.export(settings.output, params, model, 'clip_vision', shard_bytes=settings.shard_bytes)
  distributed.sync(f'exported {settings.output}')
  logging.info('exported the %s merge (%s) to %s', settings.method, settings.regime,
               settings.output)
  return settings.output
