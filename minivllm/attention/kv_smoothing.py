"""The per-channel factors an int8k_int8v cache divides its keys by (SmoothQuant's migration,
all of it onto the query).

Some models' keys have outlier channels: Qwen2's k bias makes a few of a head's channels
~10-50x the others, and with one int8 scale per (token, KV head) the other channels then
keep only a few levels (Qwen2.5-Coder-0.5B: +4.2% perplexity). Which channels, and by how
much, is a property of the layer's weights, the same for every input. So each attention
layer keeps one factor per (KV head, channel), a power of two: the keys are written
divided by it and the queries multiplied by it, which leaves every score q . k unchanged
(exactly: a power of two only moves the exponent), and the stored keys have no outlier
channel for the row's one scale.

The factors come from one calibration forward at start-up (the worker's): CALIBRATION_TOKENS
seeded random token ids, no text, the same ids for every process and run, so the factors,
and a cache's bytes, are a function of the model alone. A channel's factor is how far its
largest |k| there stands above the head's median channel's, rounded up to a power of two;
channels at or below the median keep 1 (kv_cache_quality.py's k8smooth simulations:
Qwen2.5 +0.0% perplexity and 99.2% top-1 over 4k tokens, SmolLM2 +0.0% and 99.1% over 20k).
"""

from __future__ import annotations

import torch

CALIBRATION_TOKENS = 512
_SEED = 53


def calibration_ids(vocab_size: int, num_tokens: int) -> torch.Tensor:
    """[num_tokens] int64: the calibration forward's token ids, seeded, uniform over the
    vocabulary."""
    gen = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab_size, (num_tokens,), generator=gen)


def key_factors(key_amax: torch.Tensor) -> torch.Tensor:
    """[Hkv, D] largest |k| of each channel seen in calibration -> [Hkv, D] float32 powers
    of two >= 1: 2 ** ceil(log2(amax / the head's median)), 1 at or below the median."""
    amax = key_amax.float()
    median = amax.median(-1, keepdim=True).values
    ratio = torch.where(median > 0, amax / median.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
    ratio = torch.nan_to_num(ratio, nan=1.0)
    return torch.exp2(torch.ceil(torch.log2(ratio.clamp(1.0, 2.0**60)))).contiguous()
