"""Attention-only fine-tuning: only the attention projection weights Wq, Wk, Wv, Wo train.

Jin et al., "Fine-Tuning Attention Modules Only: Enhancing Weight Disentanglement in Task
Arithmetic", ICLR 2025. Their biases, the LayerNorms, the MLPs, the embeddings and the head stay
frozen ("bias+attn" is only an ablation in the paper). Frozen leaves are never differentiated and
get no optimizer state, because the training loop splits them out before `jax.grad`.
"""

from editing.regimes.base import Regime

ATTENTION_WEIGHTS = r'blocks_\d+/attn/(query|key|value|out)/kernel'

ATTENTION_ONLY = Regime('attention_only', trainable_patterns=(ATTENTION_WEIGHTS,))
