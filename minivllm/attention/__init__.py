"""Attention backends: each owns its KV cache layout, its metadata and the paged attention."""
