"""Models: reading checkpoints (safetensors, GGUF), the shared layers, each architecture."""
