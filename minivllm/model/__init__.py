"""Models: reading checkpoints (loader/), the shared layers, each architecture."""
