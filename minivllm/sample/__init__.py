"""Sampling for the whole batch: logits to next tokens (penalties, temperature, top-k/p, min-p)."""
