"""The model: the decoder, its KV cache, parallel state and sharding, checkpoints and their conversion,
presets, tokenizers."""
