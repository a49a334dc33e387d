"""The attention layer every model uses: RoPE (optional), the cache write and the paged read
through the platform's backend, a per-layer sliding window, the scale, a logit soft-cap and
attention sinks; or, for a layer that shares another's KV cache (Gemma 4's last layers), the
read of that layer's cache.

The model computes q, k and v (its projections, per-head norms, any scaling of its own) and
projects the output; the layer owns the heads' shape and the layer's KV cache, which the
worker binds after sizing it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.kv_smoothing import key_factors


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
        kv_sharing_target: Attention | None = None,
    ) -> None:
        """num_heads, num_kv_heads: this rank's; rotary(positions, q, k) -> (q, k), or None
        for a model without RoPE; sinks: this rank's heads' attention sinks (gpt-oss), a
        parameter the layer holds (its maker gives it the weight loader of its rank).

        kv_sharing_target (vLLM's name): an earlier layer whose keys and values this one
        attends over, with no cache or K/V projections of its own. It takes k = v = None
        and uses the target's from the same step (the target keeps them, rotated, until
        the next step); the worker gives it no cache, so ``attention_layers()`` leaves it
        out."""
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
        # Held in a tuple, not as a child module (that would list it twice in the model).
        self._kv_source = (kv_sharing_target,) if kv_sharing_target is not None else ()
        self.keeps_kv = False  # whether a later layer reads this one's K/V (last_kv)
        self.last_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        if kv_sharing_target is not None:
            if (kv_sharing_target.num_kv_heads, kv_sharing_target.head_dim) != (
                num_kv_heads,
                head_dim,
            ):
                raise ValueError("a layer sharing KV must have its target's KV heads")
            kv_sharing_target.keeps_kv = True
        # int8k_int8v (kv_smoothing.py): the keys' per-channel factors [Hkv, D] once
        # calibrated (None: 1), kept as the queries' multipliers [H, D] and the keys'
        # [Hkv, D]; while calibrating, the largest |k| of each channel seen.
        self.key_factors: torch.Tensor | None = None
        self._query_factors: torch.Tensor | None = None
        self._key_divisors: torch.Tensor | None = None
        self.key_amax: torch.Tensor | None = None

    def begin_key_calibration(self) -> None:
        """From now until ``end_key_calibration``, keys are written as they are and each
        channel's largest |k| is noted."""
        self.key_amax = torch.zeros(self.num_kv_heads, self.head_dim)
        self.key_factors = self._query_factors = self._key_divisors = None

    def end_key_calibration(self, dtype: torch.dtype, device: torch.device) -> None:
        """The factors from what the calibration saw, as tensors of the model's dtype on
        its device (a power of two is exact in any float type)."""
        self.set_key_factors(key_factors(self.key_amax), dtype, device)
        self.key_amax = None

    def set_key_factors(self, factors: torch.Tensor, dtype: torch.dtype, device) -> None:
        self.key_factors = factors
        group = self.num_heads // self.num_kv_heads
        self._query_factors = factors.repeat_interleave(group, 0).to(device, dtype)
        self._key_divisors = (1.0 / factors).to(device, dtype)

    @property
    def kv_sharing_target(self) -> Attention | None:
        return self._kv_source[0] if self._kv_source else None

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, num_heads * head_dim] or [T, num_heads, head_dim]
        k: torch.Tensor | None,  # [T, num_kv_heads * head_dim] or [T, num_kv_heads, head_dim]
        v: torch.Tensor | None,  # (None: a layer sharing its target's)
        metadata: Any,  # the backend's, built once per step
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        q = q.view(-1, self.num_heads, self.head_dim)
        target = self.kv_sharing_target
        if target is not None:
            k, v = target.last_kv
            kv_cache = target.kv_cache
            if self.rotary is not None:  # q alone: the target's k is turned already
                q, _ = self.rotary(positions, q, q.new_empty(q.shape[0], 0, self.head_dim))
        else:
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            kv_cache = self.kv_cache
            if self.rotary is not None:
                q, k = self.rotary(positions, q, k)
            if self.keeps_kv:
                self.last_kv = (k, v)
        if self.backend.kv_format.smooth_keys:
            q, k = self._smoothed(q, k, target or self)
        # A sharing layer writes its target's K/V again, into the same slots: the same
        # numbers, and every backend's path (prefill chunks read this step's K/V directly).
        return self.backend.forward(
            q,
            k,
            v,
            kv_cache,
            metadata,
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            self.sinks,
        )

    def _smoothed(self, q: torch.Tensor, k: torch.Tensor, source: Attention):
        """q times and k over the factors of the layer whose cache k goes to (``source``):
        scores unchanged, keys stored without outlier channels. Each a mul writing a new
        tensor (``out=``), which a CPU graph replays."""
        if source.key_amax is not None:  # calibrating: note the float keys, write them
            if source is self:
                self.key_amax = torch.maximum(self.key_amax, k.detach().abs().amax(0).float().cpu())
            return q, k
        if source.key_factors is None:
            return q, k
        q = torch.mul(q, source._query_factors, out=q.new_empty(q.shape))
        k = torch.mul(k, source._key_divisors, out=k.new_empty(k.shape))
        return q, k
