"""Hugging Face transformers' BertModel ↔ editmerge's BERT encoder (`editing/models/bert.py`).

Source: transformers, models/bert/modeling_bert.py (BertEmbeddings, BertSelfAttention,
BertSelfOutput, BertIntermediate, BertOutput, BertPooler, BertModel) and configuration_bert.py.
Checkpoints of a task model (BertForSequenceClassification, BertForMaskedLM, ...) hold the same
tensors under `bert.`; their heads are not this map's. Sentence-transformers' all-MiniLM-L6-v2
is a BertModel with mean pooling (its 1_Pooling/config.json).
"""

ACTIVATIONS = {'gelu': 'gelu', 'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh'}
# Buffers saved beside the weights that are not parameters.
IGNORED = ('embeddings.position_ids',)

_LAYER = 'encoder.layer.{i}.'
RULES = (
    ('word_embeddings/embedding', 'embeddings.word_embeddings.weight', 'copy'),
    ('position_embeddings/embedding', 'embeddings.position_embeddings.weight', 'copy'),
    ('token_type_embeddings/embedding', 'embeddings.token_type_embeddings.weight', 'copy'),
    ('ln_embed/scale', 'embeddings.LayerNorm.weight', 'copy'),
    ('ln_embed/bias', 'embeddings.LayerNorm.bias', 'copy'),
    ('blocks_{i}/attn/query/kernel', _LAYER + 'attention.self.query.weight', 'heads_in'),
    ('blocks_{i}/attn/query/bias', _LAYER + 'attention.self.query.bias', 'heads_bias'),
    ('blocks_{i}/attn/key/kernel', _LAYER + 'attention.self.key.weight', 'heads_in'),
    ('blocks_{i}/attn/key/bias', _LAYER + 'attention.self.key.bias', 'heads_bias'),
    ('blocks_{i}/attn/value/kernel', _LAYER + 'attention.self.value.weight', 'heads_in'),
    ('blocks_{i}/attn/value/bias', _LAYER + 'attention.self.value.bias', 'heads_bias'),
    ('blocks_{i}/attn/out/kernel', _LAYER + 'attention.output.dense.weight', 'heads_out'),
    ('blocks_{i}/attn/out/bias', _LAYER + 'attention.output.dense.bias', 'copy'),
    ('blocks_{i}/ln_1/scale', _LAYER + 'attention.output.LayerNorm.weight', 'copy'),
    ('blocks_{i}/ln_1/bias', _LAYER + 'attention.output.LayerNorm.bias', 'copy'),
    ('blocks_{i}/mlp_fc/kernel', _LAYER + 'intermediate.dense.weight', 'linear'),
    ('blocks_{i}/mlp_fc/bias', _LAYER + 'intermediate.dense.bias', 'copy'),
    ('blocks_{i}/mlp_proj/kernel', _LAYER + 'output.dense.weight', 'linear'),
    ('blocks_{i}/mlp_proj/bias', _LAYER + 'output.dense.bias', 'copy'),
    ('blocks_{i}/ln_2/scale', _LAYER + 'output.LayerNorm.weight', 'copy'),
    ('blocks_{i}/ln_2/bias', _LAYER + 'output.LayerNorm.bias', 'copy'),
    ('pooler/kernel', 'pooler.dense.weight', 'linear'),
    ('pooler/bias', 'pooler.dense.bias', 'copy'),
)


def model_config(config: dict, *, pooling: str = 'mean') -> dict:
  """Our `config.model` (editing/models/bert.py) from their config.json."""
  act = config.get('hidden_act', 'gelu')
  if act not in ACTIVATIONS:
    raise ValueError(f'hidden_act {act!r} has no counterpart here; known: {sorted(ACTIVATIONS)}')
  return {'family': 'bert', 'vocab_size': config['vocab_size'], 'width': config['hidden_size'],
          'depth': config['num_hidden_layers'], 'num_heads': config['num_attention_heads'],
          'mlp_dim': config['intermediate_size'],
          'max_positions': config.get('max_position_embeddings', 512),
          'type_vocab_size': config.get('type_vocab_size', 2), 'activation': ACTIVATIONS[act],
          'layer_norm_epsilon': config.get('layer_norm_eps', 1e-12), 'pooling': pooling,
          'dtype': 'float32'}


def hf_config(model: dict) -> dict:
  """A BertModel config.json for our `config.model`."""
  act = {'gelu': 'gelu', 'gelu_tanh': 'gelu_pytorch_tanh'}
  return {'architectures': ['BertModel'], 'model_type': 'bert', 'vocab_size': model['vocab_size'],
          'hidden_size': model['width'], 'num_hidden_layers': model['depth'],
          'num_attention_heads': model['num_heads'], 'intermediate_size': model['mlp_dim'],
          'max_position_embeddings': model['max_positions'],
          'type_vocab_size': model['type_vocab_size'], 'hidden_act': act[model['activation']],
          'layer_norm_eps': model['layer_norm_epsilon'], 'pad_token_id': 0,
          'torch_dtype': model.get('dtype', 'float32')}
