"""The attention layer every model uses: RoPE (optional), the cache write and the paged read
through the platform's backend, a per-layer sliding window, the scale, a logit soft-cap and
attention sinks.

The model computes q, k and v (its projections, per-head norms, any scaling of its own) and
projects the output; the layer owns the heads' shape and the layer's KV cache, which the
worker binds after sizing it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
        rotary: nn.Module | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: nn.Parameter | None = None,
    ) -> None:
        """num_heads, num_kv_heads: this rank's; rotary(positions, q, k) -> (q, k), or None
        for a model without RoPE; sinks: this rank's heads' attention sinks (gpt-oss), a
        parameter the layer holds (its maker gives it the weight loader of its rank)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.sinks = sinks
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None  # bound by the worker after sizing

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, num_heads * head_dim] or [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim] or [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        metadata: Any,  # the backend's, built once per step
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        return self.backend.forward(
            q,
            k,
            v,
            self.kv_cache,
            metadata,
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            self.sinks,
        )
