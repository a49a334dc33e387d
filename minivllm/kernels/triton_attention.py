"""Triton kernel for paged attention on the GPU: one attention kernel for a whole mixed
batch (prefill chunks and single-token rows in one launch); the KV cache write is in
triton_kv_cache.py.

It takes the flat metadata of a step: ``query_start_loc`` [B+1] int32 (request i owns
query rows [qsl[i], qsl[i+1])), ``seq_lens`` [B] int32 (its context including this step's
tokens), ``block_table`` [B, max_blocks] int32 and ``slot_mapping`` [T] int64. A cache
is [num_blocks, block_size, num_kv_heads, head_dim] for keys and the same for values.

Grid of the attention kernel (the design of vLLM's unified Triton attention): one program
per (block of BLOCK_Q query tokens of one request, KV head). Its BLOCK_M = BLOCK_Q * G rows
are those query tokens times the G query heads that share the KV head, so a decode row
still fills a tensor-core tile when G is large, and a long chunk is cut into blocks that
run side by side. The program finds its request by a binary search over query_start_loc,
then walks the keys it may see (causal, inside the window) in tiles of TILE keys, each key
found through the block table, with an online softmax in float32.

A quantized cache (``--kv-cache-dtype``, attention/kv_quant.py) is uint8 with head rows of
``row_width(head_dim)`` bytes: int8 values then their float32 scale, or fp8 bits, or
(fp16k_int8v, fp16k_e4m3v, fp16k_e5m2v) float16 keys, their rows' values (int8 or fp8, and
a scale) from byte 2 * head_dim on. The write
quantizes (``KV_TYPE``); the attention kernel widens each tile as it loads it (no
dequantized copy), applies the keys' int8 scales to the scores and folds the values'
into the softmax weights.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (the tests' way in CI). The
interpreter keeps bfloat16 as raw 16-bit integers and cannot multiply them, so there
bfloat16 tiles are widened to float32 before each dot; on the GPU they go to the tensor
cores as they are, accumulating in float32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.triton_kv_cache import KV_SCALED_VALUES, _fp8_to_float

# Triton reads the switch when a kernel is defined (at this module's import): then the
# kernels take CPU tensors, and only CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _find_request(query_start_loc_ptr, program, num_seqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks hold this program: request i's blocks are numbered
    from qsl[i] // BLOCK_Q + i on (an upper bound of the blocks before it, so that every
    request's first block starts a new number)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _soft_cap(s, cap):
    # cap * tanh(s / cap), written so that it saturates instead of overflowing.
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def _unified_attention_kernel(
    out_ptr,
    part_out_ptr,  # split-KV partials (NUM_SPLITS > 1): [T, H, NUM_SPLITS, HEAD_DIM_PADDED]
    part_max_ptr,  # [T, H, NUM_SPLITS]: each split's running max (log2 units)
    part_sum_ptr,  # [T, H, NUM_SPLITS]: each split's sum of exponentials
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,  # [NUM_HEADS] float32: each head's attention sink (USE_SINKS)
    num_seqs,
    scale,  # float: softmax scale
    soft_cap,  # float: used when USE_SOFT_CAP
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_block: tl.int64,
    cache_stride_slot: tl.int64,
    cache_stride_head: tl.int64,
    block_table_stride,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: >= BLOCK_Q * GROUP, a power of two
    TILE: tl.constexpr,  # keys per step of the loop
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    WIDEN: tl.constexpr,  # compute the dots in float32 (float32 inputs, the interpreter)
    NUM_SPLITS: tl.constexpr,  # > 1: the keys are cut in NUM_SPLITS ranges (grid axis 2)
    KV_TYPE: tl.constexpr = 0,  # the cache's elements: 0 q's dtype, else KVCacheFormat.code
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_request(query_start_loc_ptr, program, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = program - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # query i of the request sits at position context_len + i

    # Row m: query token q_block * BLOCK_Q + m // GROUP, query head kv_head * GROUP + m % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_t = tl.arange(0, TILE)
    q_index = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_index < q_len)
    dim_ok = offs_d < HEAD_DIM
    q_pos = context_len + q_index

    token = (q_start + q_index).to(tl.int64)
    q_off = token[:, None] * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)

    # The keys any row of this program may see: [lo, hi).
    first_q_pos = context_len + q_block * BLOCK_Q
    last_q_pos = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len) - 1
    hi = last_q_pos + 1
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(first_q_pos - SLIDING_WINDOW + 1, 0)

    # Tiles [tile_lo, tile_hi) of TILE keys; with split-KV, this program's share of them.
    tile_lo = lo // TILE
    tile_hi = tl.cdiv(hi, TILE)
    if NUM_SPLITS > 1:
        split = tl.program_id(2)
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        # The sink is a key of score `sink` and no value: the running max and sum start
        # from it (in one split only, which the merge then weighs as any other).
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        if NUM_SPLITS > 1:
            sink = tl.where(tl.program_id(2) == 0, sink, float("-inf"))
        m_i = sink * 1.4426950408889634  # log2 units
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * block_table_stride
    kv_head_off = kv_head * cache_stride_head

    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE + offs_t
        key_ok = (key_pos >= lo) & (key_pos < hi)
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_off = block * cache_stride_block + (key_pos % BLOCK_SIZE) * cache_stride_slot
        kv_off += kv_head_off
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        # K^T: [HEAD_DIM_PADDED, TILE]; V: [TILE, HEAD_DIM_PADDED].
        k_rows = k_cache_ptr + kv_off[None, :]
        if KV_TYPE >= 4:  # float16 keys (a uint8 cache's rows)
            k_rows = k_rows.to(tl.pointer_type(tl.float16))
        k = tl.load(k_rows + offs_d[:, None], mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_TYPE >= 4:  # int8 or fp8 values, each row's scale after its HEAD_DIM bytes
            if KV_TYPE == 4:
                v = v.to(tl.int8, bitcast=True)
            else:
                v = _fp8_to_float(v, KV_TYPE - 3)
            v_scale = tl.load(
                (v_cache_ptr + kv_off + HEAD_DIM).to(tl.pointer_type(tl.float32)),
                mask=key_ok,
                other=0.0,
            )
        elif KV_TYPE == 1:  # int8: the integers; the scales after each row's HEAD_DIM bytes
            k = k.to(tl.int8, bitcast=True)
            v = v.to(tl.int8, bitcast=True)
            k_scale = tl.load(
                (k_cache_ptr + kv_off + HEAD_DIM).to(tl.pointer_type(tl.float32)),
                mask=key_ok,
                other=0.0,
            )
            v_scale = tl.load(
                (v_cache_ptr + kv_off + HEAD_DIM).to(tl.pointer_type(tl.float32)),
                mask=key_ok,
                other=0.0,
            )
        elif KV_TYPE == 2 or KV_TYPE == 3:  # fp8
            k = _fp8_to_float(k, KV_TYPE)
            v = _fp8_to_float(v, KV_TYPE)
        if WIDEN:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        if KV_TYPE == 1:
            s = s * k_scale[None, :]
        s = s * scale
        if USE_SOFT_CAP:
            s = _soft_cap(s, soft_cap)
        visible = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s * 1.4426950408889634, float("-inf"))  # in log2 units

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps -inf; subtract 0 there so exp2 gives 0, not nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = p
        if KV_TYPE == 1 or KV_TYPE >= 4:  # each value row's scale, folded into its weight
            pv = p * v_scale[None, :]
        if WIDEN:
            acc = acc * alpha[:, None] + tl.dot(pv, v.to(tl.float32), input_precision="ieee")
        elif KV_TYPE:
            acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v.to(q.dtype))
        else:
            acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_off = token[:, None] * out_stride_t + head[:, None] * out_stride_h + offs_d[None, :]
        tl.store(
            out_ptr + o_off,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:  # unnormalized: _merge_splits_kernel weighs the splits against each other
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        part_off = part[:, None] * HEAD_DIM_PADDED + offs_d[None, :]
        tl.store(part_out_ptr + part_off, acc, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_start_loc_ptr,
    num_seqs,
    out_stride_t,
    out_stride_h,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):  # a padded row: no partials
        return
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    part = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_max_ptr + part)
    m_all = tl.max(m, axis=0)  # finite: every query sees at least its own key
    weight = tl.exp2(m - m_all)  # 0 for a split that saw no key (max -inf)
    total = tl.sum(tl.load(part_sum_ptr + part) * weight, axis=0)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PADDED + offs_d[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / total
    o_off = token.to(tl.int64) * out_stride_t + head * out_stride_h + offs_d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def launch_config(
    dtype: torch.dtype, group: int, head_dim_padded: int, max_query_len: int, kv_type: int = 0
) -> tuple[int, int, int]:
    """(BLOCK_M rows, TILE keys, warps) of the attention kernel. At least 16 rows (the
    smallest tensor-core tile): a decode row fills them with its query heads, a chunk with
    up to 16 // group tokens of them. With a long chunk in the batch, 16-bit inputs take 64
    rows, so that each key tile is read for 4x the queries. float32 (exact dots on the CUDA
    cores, for comparisons) takes small tiles and 16 warps (with 8, Triton 3.6's ptxas
    spills for head_dim 256 and for split-KV). All chosen so that ptxas spills no register
    on sm_90 with Triton 3.6 and 3.9 (tests/kernels/triton_compile_check.py); speed not
    yet measured. An int8 cache's scales take registers too: its decodes take 8 warps (with
    4, ptxas spilled for head_dim 64)."""
    block_m = max(16, triton.next_power_of_2(group))
    if dtype == torch.float32:
        return block_m, 16, 16
    if max_query_len >= 64 and head_dim_padded <= 128:
        return max(64, block_m), 32, 8
    return block_m, 32, 8 if kv_type in KV_SCALED_VALUES else 4


def unified_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, num_heads, head_dim], written
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    num_kv_splits: int = 1,
    max_query_len: int = 1,
    sinks: torch.Tensor | None = None,
    kv_type: int = 0,
) -> torch.Tensor:
    """Causal attention of every query row over its request's paged context (the cache
    must already hold this step's K/V). kv_type: the cache's KVCacheFormat.code (0: q's
    dtype; else uint8 rows, read in place). sliding_window W: a query at position p sees keys
    in (p - W, p]; logits_soft_cap c: scores become c * tanh(s / c) before the softmax.
    num_kv_splits S (a power of two) > 1: each program's keys are cut in S ranges that run
    in parallel, merged by a second kernel (split-KV, for few long decodes).
    max_query_len: the longest request's query rows; long chunks take taller programs.
    sinks [num_heads] float32: each head's attention sink, a logit in the softmax's
    denominator with no value (gpt-oss)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert q.stride(2) == 1 and out.stride(2) == 1
    assert num_kv_splits >= 1 and num_kv_splits & (num_kv_splits - 1) == 0
    group = num_heads // num_kv_heads
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))

    block_m, tile, num_warps = launch_config(
        q.dtype, group, head_dim_padded, max_query_len, kv_type
    )
    block_q = block_m // group
    # Request i's blocks are numbered from qsl[i] // block_q + i on: this bounds them all.
    num_q_blocks = num_tokens // block_q + num_seqs
    # float32 takes exact (ieee) dots, not TF32. The interpreter cannot multiply bfloat16;
    # float16 it can, and runs the GPU's path for 16-bit inputs.
    widen = q.dtype == torch.float32 or (INTERPRETED and q.dtype == torch.bfloat16)
    grid = (num_q_blocks, num_kv_heads, num_kv_splits)
    if num_kv_splits > 1:
        part_out = q.new_empty(
            num_tokens, num_heads, num_kv_splits, head_dim_padded, dtype=torch.float32
        )
        part_max = q.new_empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # not read
    _unified_attention_kernel[grid](
        out,
        part_out,
        part_max,
        part_sum,
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        sinks if sinks is not None else out,  # not read without sinks
        num_seqs,
        scale,
        float(logits_soft_cap or 0.0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE=tile,
        SLIDING_WINDOW=int(sliding_window or 0),
        USE_SOFT_CAP=bool(logits_soft_cap),
        USE_SINKS=sinks is not None,
        WIDEN=widen,
        NUM_SPLITS=num_kv_splits,
        KV_TYPE=kv_type,
        num_warps=num_warps,
    )
    if num_kv_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            query_start_loc,
            num_seqs,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            NUM_SPLITS=num_kv_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
        )
    return out


def choose_kv_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, max_splits: int
) -> int:
    """Split-KV for batches of single-token rows whose programs are too few to fill the
    GPU and whose contexts are long: enough splits for ~256 programs, each with at least
    512 keys. (A first guess, to be tuned on the device: not yet measured.)"""
    if max_splits <= 1 or max_query_len > 1:
        return 1
    splits = 1
    while (
        splits < max_splits
        and num_seqs * num_kv_heads * splits * 2 <= 256
        and max_seq_len >= 512 * splits * 2
    ):
        splits *= 2
    return splits
