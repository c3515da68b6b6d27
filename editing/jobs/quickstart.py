"""The whole chain on the built-in suite: pretrain (once), fine-tune every task in every
configured regime, evaluate.

Finished work in the workdir (pretrained backbone, task vectors) is reused on a rerun, and an
interrupted fine-tune resumes from its last checkpoint.
"""

import os
import time

import ml_collections
from absl import logging

from editing import atomic
from editing.jobs import evaluate
from editing.jobs import checks
from editing.jobs import experiment
from editing.jobs import finetune
from editing.jobs import pretrain

SECTIONS = {**pretrain.SECTIONS, **finetune.SECTIONS, **evaluate.SECTIONS}


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Returns the evaluation's results, with the seconds each stage took."""
  checks.validate(config, SECTIONS)
  names = experiment.tasks(config)
  regimes = experiment.configured_regimes(config)
  timings = {}
  start = time.time()
  pretrain.run(config, workdir)
  timings['pretrain'] = time.time() - start
  for regime in regimes:
    regime_start = time.time()
    for i, task in enumerate(names):
      logging.info('fine-tuning %s in the %s regime (%d/%d)', task, regime.name, i + 1,
                   len(names))
      finetune.run(config, workdir, task, regime)
    timings[f'finetune_{regime.name}'] = time.time() - regime_start
  timings['finetune'] = time.time() - start - timings['pretrain']
  results = evaluate.run(config, workdir)
  timings['evaluate'] = time.time() - start - timings['pretrain'] - timings['finetune']
  timings['total'] = time.time() - start
  results['seconds'] = timings
  atomic.write_json(os.path.join(workdir, 'results.json'), results)
  logging.info('quickstart took %.0f s (%s); results in %s', timings['total'],
               ', '.join(f'{k} {v:.0f} s' for k, v in timings.items()), workdir)
  return results
