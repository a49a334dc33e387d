"""Attention over the paged KV cache: the metadata the runner builds, and the backend API.

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(keys, values); a token at position p of a request lives in block table[p // block_size],
slot p % block_size, and slot_mapping gives each token of the batch its flat slot. How a
block's numbers are arranged inside it is the backend's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One request with several query tokens: rows [start, end) of the batch."""

    start: int
    end: int
    seq_len: int  # tokens of context including this chunk
    block_ids: torch.Tensor  # [num_blocks] long


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] long, flat slot of each token's K/V
    # Requests with a single query token, batched together.
    decode_indices: torch.Tensor  # [num_decodes] long, their rows in the batch
    decode_block_table: torch.Tensor  # [num_decodes, max_blocks] long
    decode_seq_lens: torch.Tensor  # [num_decodes] long
    # Requests with several query tokens (prefill chunks), handled one by one.
    prefills: list[PrefillSpan]

    @property
    def num_decodes(self) -> int:
        return self.decode_indices.numel()


class AttentionBackend:
    """Writes this step's K/V into the cache, then attends. Implementations per device.

    Safety rule: every K/V of the batch is written before any query reads the cache, so a
    request may read a block that another request of the same step writes.
    """

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """sliding_window W: a query at position p sees keys at positions (p - W, p] only.
        logits_soft_cap c: scores become c * tanh(scores / c) before the softmax."""
        raise NotImplementedError
