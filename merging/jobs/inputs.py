"""What a data-driven merge reads besides the task vectors (`merging.INPUTS`), built from an
experiment on demand: θ0, the model's apply_fn, a key, and each task's data as
`merging.common.TaskData` (a decoder's text tasks as answer-token samples)."""

import dataclasses
from typing import Any

import jax
import ml_collections
import numpy as np

import merging
from editing import text_finetune
from editing.errors import UserError
from editing.jobs import experiment
from editing.models import head as head_lib
from merging import common


@dataclasses.dataclass(frozen=True)
class MergeInputs:
  """What a method may read besides the task vectors (`merging.INPUTS`), built on demand."""

  config: ml_collections.ConfigDict
  encoder: Any
  theta0: Any
  apply_fn: Any
  heads: dict
  data: dict  # task name -> suite.Task
  extra: dict = dataclasses.field(default_factory=dict)  # e.g. the oracle's trigger

  def task_data(self, split: str) -> dict[str, common.TaskData]:
    """Each task's logits_fn (the regime's encoder, its frozen head) and inputs: the first
    config.merge.train_examples labeled training examples, or every unlabeled test input (a
    decoder's: `text_task_data`)."""
    if experiment.is_decoder(self.config):
      return {t: text_task_data(self.encoder, self.theta0, task, split,
                                self.config.merge.train_examples)
              for t, task in self.data.items()}
    out = {}
    for t, task in self.data.items():
      logits_fn = head_lib.logits_fn(self.encoder, self.theta0, self.heads[t],
                                     self.config.head.logit_scale)
      if split == 'train':
        n = min(self.config.merge.train_examples, len(task.train))
        images, labels = task.train.batch(np.arange(n))
        out[t] = common.TaskData(logits_fn, images, labels)
      else:
        images, _ = task.test.batch(np.arange(len(task.test)))
        out[t] = common.TaskData(logits_fn, images)
    return out

  def read_by(self, name: str) -> dict:
    """The keyword inputs method `name` reads."""
    method = merging.get(name)
    available = {'key': jax.random.PRNGKey(self.config.merge.seed), 'theta0': self.theta0,
                 'apply_fn': self.apply_fn, **self.extra}
    missing = [r for r in method.reads if r != 'data' and r not in available]
    if missing:
      raise UserError(f'{name} reads {missing}, which this experiment does not provide')
    reads = {k: available[k] for k in method.reads if k != 'data'}
    if 'data' in method.reads:
      reads['data'] = self.task_data(method.split)
    return reads


def text_task_data(encoder, theta0, task: text_finetune.TextTask, split: str,
                   train_examples: int) -> common.TaskData:
  """A text task as a data-driven merge reads it (`merging.common.TaskData`), each answer
  token one sample read at the position before it: on 'train', every answer token of the
  first `train_examples` training rows, labeled; on 'test', the first answer token of every
  test row, unlabeled, so that what is read there sees the prompt alone and never the answer.
  `encoder` is the regime's encoder(θ0, params, inputs)."""
  if split == 'train':
    data = task.train.take(train_examples)
  else:
    data = task.test
    first = np.argmax(data.loss_mask > 0, axis=1)
    only_first = np.zeros_like(data.loss_mask)
    only_first[np.arange(len(data)), first] = 1
    data = dataclasses.replace(data, loss_mask=only_first)
  inputs = text_finetune.answer_token_inputs(data)
  labels = data.tokens[np.nonzero(data.loss_mask)] if split == 'train' else None
  return common.TaskData(
      lambda params, x: text_finetune.read_logits(encoder(theta0, params, x), x), inputs, labels)
