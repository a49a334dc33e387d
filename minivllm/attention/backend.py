"""Attention over the paged KV cache: the flat metadata the runner builds, and the backend API.

A request's token at position p lives in block ``block_table[i, p // block_size]``, slot
``p % block_size``; ``slot_mapping`` gives each token of the batch its flat slot
(block * block_size + offset). Each backend says how its cache tensor is shaped
(``get_kv_cache_shape``) and how a block's numbers are arranged inside it, and turns the
flat metadata into what its kernels take (``build_metadata``, once per step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.attention.kv_quant import KVCacheFormat, kv_cache_format


@dataclass
class CommonAttentionMetadata:
    """What the runner builds each step, in the form GPU kernels take (FlashAttention varlen,
    vLLM's Triton unified attention): request i's query tokens are rows
    [query_start_loc[i], query_start_loc[i + 1]) of the batch."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context including this step's tokens
    block_table: torch.Tensor  # [B, max_blocks] int32 (padded with 0)
    slot_mapping: torch.Tensor  # [T] int64
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor  # host copies (equal to the above on the CPU)
    seq_lens_cpu: torch.Tensor


class AttentionBackend:
    """Writes this step's K/V into the cache, then attends. One instance per worker (the
    platform makes it); the runner calls ``build_metadata`` once per step and every layer
    gets its result.

    Safety rule: every K/V of the batch is written before any query reads the cache, so a
    request may read a block that another request of the same step writes.

    ``kv_format``: what the cache holds (``--kv-cache-dtype``); a backend that quantizes
    sets it from its ``kv_cache_dtype`` argument, quantizes as it writes and reads the
    quantized cache in place.
    """

    kv_format: KVCacheFormat = kv_cache_format("auto")

    @staticmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """The shape of one layer's cache tensor (keys and values)."""
        raise NotImplementedError

    def kv_cache_spec(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one layer's cache tensor, for a model of ``dtype``: a quantized
        cache is bytes, its head rows widened by their scales."""
        width = self.kv_format.row_width(head_dim)
        shape = self.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, width)
        return shape, self.kv_format.storage_dtype(dtype)

    def new_kv_cache(
        self,
        zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """One layer's cache tensor of ``kv_cache_spec``'s shape, zero-filled by ``zeros``
        (the platform's). A block-major format (kv_quant.py: keys and values of different
        sizes, kept side by side) is allocated [num_blocks, 2, ...] and seen as [2,
        num_blocks, ...], so that ``cache[:, block]`` is still a block's bytes, contiguous."""
        shape, storage = self.kv_cache_spec(num_blocks, block_size, num_kv_heads, head_dim, dtype)
        if not self.kv_format.block_major:
            return zeros(shape, storage)
        return zeros((shape[1], shape[0], *shape[2:]), storage).transpose(0, 1)

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """This backend's metadata for the step (what ``forward`` takes)."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """sliding_window W: a query at position p sees keys at positions (p - W, p] only.
        logits_soft_cap c: scores become c * tanh(scores / c) before the softmax.
        sinks [num_heads] float32 (gpt-oss): each head's attention sink, a logit that joins
        the softmax's denominator with no value, so a query may attend to nothing much."""
        raise NotImplementedError
