"""Models: Flax linen encoders and the frozen heads that read their embeddings."""
