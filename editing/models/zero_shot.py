"""Zero-shot classification heads from CLIP's text tower (Radford et al., 2021).

For classes with names n_c and prompt templates T (each with one '{}' for the name), the head
is the matrix of unit rows

  w_c = normalize( Σ_t normalize( g(t.format(n_c)) ) ),

g the text tower (`editing/models/clip_text.py`) of θ0. With `head.logits(f(x), W, s)` it gives
CLIP's zero-shot logits s · ⟨f̂(x), w_c⟩ (s = exp of CLIPModel's stored logit scale, 100 for
OpenAI's models). The task-arithmetic papers build one such head per dataset from the
pretrained text tower and freeze it: fine-tuning and merging then touch the image tower only,
exactly as the suite's prototype heads (`editing/models/head.py`) are used.

Class names and templates are the caller's: a dataset on disk names its classes (its folders,
a classnames file), and templates are a list of strings.
"""

from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from editing import batching
from editing.errors import UserError
from editing.models import clip_text
from editing.models import text


def head(text_params, text_model: dict, tokenizer: text.Tokenizer, classnames: Sequence[str],
         templates: Sequence[str], batch_size: int = 256) -> np.ndarray:
  """The (num_classes, embed_dim) zero-shot head: per class, the normalised sum of the
  normalised text embeddings of every template filled with the class's name."""
  if not classnames or not templates:
    raise UserError(f'a zero-shot head needs class names and templates; got '
                    f'{len(classnames)} names and {len(templates)} templates')
  bad = [t for t in templates if t.count('{}') != 1]
  if bad:
    raise UserError(f'every template must hold one {{}} for the class name; these do not: {bad}')
  if text_model.get('embed_dim') is None:
    raise UserError('the text tower has no projection (embed_dim is None): a zero-shot head '
                    'needs the projected embeddings the image tower is compared with')
  module = clip_text.build(ml_collections.ConfigDict(text_model))

  @jax.jit
  def encode(ids, mask):
    embeddings = module.apply({'params': text_params}, ids, mask).astype(jnp.float32)
    return embeddings / jnp.linalg.norm(embeddings, axis=-1, keepdims=True)

  prompts = [template.format(name) for name in classnames for template in templates]
  tokens = tokenizer(prompts)
  embedded = []
  for batch in batching.padded_batches([tokens['input_ids'], tokens['attention_mask']],
                                       min(batch_size, len(prompts))):
    embedded.append(np.asarray(encode(*batch.arrays))[:batch.count])
  per_prompt = np.concatenate(embedded).reshape(len(classnames), len(templates), -1)
  summed = per_prompt.sum(axis=1)
  return summed / np.linalg.norm(summed, axis=-1, keepdims=True)
