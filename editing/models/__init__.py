"""Models: Flax linen encoders and the frozen heads that read their embeddings, and one decoder
language model for Llama, Mistral, Qwen2/3 and Gemma 2/3 (`decoder`, `decoder_config`)."""
