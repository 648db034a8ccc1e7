"""The model: Llama forward pass, config, RoPE, checkpoints (HF, GGUF), loading, TP sharding, registry."""
