"""Attention for the GPU: Triton kernels over the step's flat metadata, one launch each.

Layout of a layer's cache: [2, num_blocks, block_size, Hkv, D], keys then values, each
block used as allocated (a token's K or V for all KV heads is one contiguous row). With
kv_cache_dtype int8k_int8v/e4m3k_e4m3v it is uint8 with head rows of ``row_width(D)`` bytes
(int8: D values then a float32 scale), written quantized and read in place. The float16-key
layouts (``int8``, ``fp8``: fp16k_int8v, fp16k_e4m3v, fp16k_e5m2v) are block-major
(kv_quant.py): a block is [block_size, Hkv, 3 D + 4] bytes, each head row a token's float16
key, then its 8-bit value and scale (``kv_views``). The
forward pass writes this step's K/V (``reshape_and_cache``), then one unified attention
launch serves every request of the batch: single-token rows and prefill chunks alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.attention.kv_quant import KVCacheFormat, kv_cache_format
from minivllm.kernels.triton_attention import choose_kv_splits, unified_attention
from minivllm.kernels.triton_kv_cache import reshape_and_cache


@dataclass
class TritonAttentionMetadata:
    num_actual_tokens: int  # rows of the batch that are real (the rest pad a CUDA graph)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context including this step's tokens
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64; negative: write nothing
    max_query_len: int
    max_seq_len: int


class TritonAttentionBackend(AttentionBackend):
    """Safety rule (the base class's): every K/V of the batch is in the cache before any
    query reads it; the two kernels run in that order on one stream.

    block_size: unused (the cache's shape carries it); taken as every backend takes it.
    max_kv_splits: the most ranges a long decode's keys are cut in (split-KV); 1 turns
    split-KV off, to measure what it gains.
    """

    def __init__(
        self, block_size: int = 16, max_kv_splits: int = 16, kv_cache_dtype: str = "auto"
    ) -> None:
        self.max_kv_splits = max_kv_splits
        self.kv_format = kv_cache_format(kv_cache_dtype)

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """The kernels read the common metadata as it is; only the int types are checked."""
        assert common.query_start_loc.dtype == torch.int32
        assert common.seq_lens.dtype == torch.int32
        assert common.block_table.dtype == torch.int32
        assert common.slot_mapping.dtype == torch.int64
        return TritonAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: TritonAttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        num_tokens, num_heads, head_dim = q.shape
        n = metadata.num_actual_tokens
        k_cache, v_cache = kv_views(kv_cache, self.kv_format)
        kv_type = self.kv_format.code
        reshape_and_cache(k[:n], v[:n], k_cache, v_cache, metadata.slot_mapping[:n], kv_type)
        out = q.new_empty(num_tokens, num_heads, head_dim)
        splits = choose_kv_splits(
            metadata.seq_lens.shape[0],
            k_cache.shape[2],
            metadata.max_query_len,
            metadata.max_seq_len,
            self.max_kv_splits,
        )
        unified_attention(
            q,
            k_cache,
            v_cache,
            out,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            num_kv_splits=splits,
            max_query_len=metadata.max_query_len,
            sinks=sinks,
            kv_type=kv_type,
        )
        return out.view(num_tokens, num_heads * head_dim)


def kv_views(kv_cache: torch.Tensor, fmt: KVCacheFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values), each [num_blocks, block_size, Hkv, row] with the same strides (the
    kernels take one set): the two halves of the cache, or for a block-major format each
    block's [block_size, Hkv, 2 * row_width] bytes, keys from byte 0 of a row, values from
    byte 2 D."""
    if not fmt.block_major:
        return kv_cache[0], kv_cache[1]
    _, num_blocks, block_size, num_kv_heads, width = kv_cache.shape
    blocks = kv_cache.transpose(0, 1)
    if not blocks.is_contiguous():
        raise ValueError(f"a {fmt.name} cache is allocated block-major (new_kv_cache)")
    rows = blocks.reshape(num_blocks, block_size, num_kv_heads, 2 * width)
    head_dim = (2 * width - 4) // 3
    return rows, rows[..., 2 * head_dim :]
