"""Benchmark prompts with vLLM's `random` dataset conventions: seeded random token ids."""

from __future__ import annotations

import numpy as np


def random_token_prompts(
    tokenizer, num_prompts: int, input_len: int, seed: int = 0, prefix_len: int = 0
) -> list[list[int]]:
    """num_prompts lists of prefix_len shared + input_len unique random (non-special) ids."""
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    allowed = np.array([t for t in range(len(tokenizer)) if t not in special])
    prefix = rng.choice(allowed, prefix_len).tolist()
    return [prefix + rng.choice(allowed, input_len).tolist() for _ in range(num_prompts)]
