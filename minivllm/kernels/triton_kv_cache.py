"""Triton kernels that write a step's keys and values into the paged KV cache on the GPU,
and the element conversions of a quantized cache that the attention kernel
(triton_attention.py) shares.

A cache is [num_blocks, block_size, num_kv_heads, head_dim] for keys and the same for
values; ``slot_mapping`` [T] int64 gives each token's slot (block * block_size + offset).
A quantized cache (``--kv-cache-dtype``, attention/kv_quant.py) is uint8 with head rows of
``row_width(head_dim)`` bytes: int8 values then their float32 scale, or fp8 bits; the write
quantizes (``KV_TYPE``). The float16-key layouts' head rows (fp16k_int8v, fp16k_e4m3v,
fp16k_e5m2v) hold a token's key (float16, 2 D bytes) and value (int8 or fp8, and its scale)
together: the backend passes the rows as keys and the same rows from byte 2 D on as values,
with the same strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The cache's element types (KVCacheFormat.code): 0 the model's dtype, 1 int8 with a float32
# scale after each head row, 2 fp8 e4m3fn, 3 fp8 e5m2 (fp8 with scale 1, saturated), 4
# float16 keys (saturated) and int8 values, 5 (6) float16 keys and e4m3fn (e5m2) values
# scaled per row as int8's. A row quantizer (_quantize_rows) takes 4 for float16 keys, 5
# and 6 for the scaled fp8 values.
KV_INT8, KV_E4M3, KV_E5M2, KV_FP16_INT8, KV_FP16_E4M3, KV_FP16_E5M2 = 1, 2, 3, 4, 5, 6
# The codes whose values carry a float32 scale after each row.
KV_SCALED_VALUES = (KV_INT8, KV_FP16_INT8, KV_FP16_E4M3, KV_FP16_E5M2)


@triton.jit
def _fp8_to_float(x, KV_TYPE: tl.constexpr):
    """uint8 fp8 bits -> float32: the bits placed in a float32's fields, times 2^(127 - bias)
    (which makes the fp8's subnormals normal too); the same on any GPU and the interpreter."""
    b = x.to(tl.uint32)
    if KV_TYPE == 2:
        f = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
        return f * 1.329227995784916e36  # 2^120
    f = (((b & 0x80) << 24) | ((b & 0x7F) << 21)).to(tl.float32, bitcast=True)
    return f * 5.192296858534828e33  # 2^112


@triton.jit
def _float_to_fp8(x, KV_TYPE: tl.constexpr):
    """float32 -> uint8 fp8 bits, rounded to nearest even, saturated (the C kernel's rule;
    subnormals round half away from zero)."""
    if KV_TYPE == 2:
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        MAX: tl.constexpr = 448.0
        MIN_NORMAL: tl.constexpr = 0.015625  # 2^-6
        SUB_STEPS: tl.constexpr = 512.0  # 2^9
        MAX_CODE: tl.constexpr = 0x7E
    else:
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        MAX: tl.constexpr = 57344.0
        MIN_NORMAL: tl.constexpr = 6.103515625e-05  # 2^-14
        SUB_STEPS: tl.constexpr = 65536.0  # 2^16
        MAX_CODE: tl.constexpr = 0x7B
    SHIFT: tl.constexpr = 23 - MANT
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(x), MAX)
    bits = a.to(tl.uint32, bitcast=True)
    bits = bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)
    exponent = (bits >> 23).to(tl.int32) - (127 - BIAS)
    code = (exponent.to(tl.uint32) << MANT) | ((bits >> SHIFT) & ((1 << MANT) - 1))
    code = tl.minimum(code, MAX_CODE)
    sub = tl.floor(a * SUB_STEPS + 0.5).to(tl.uint32)
    code = tl.where(a < MIN_NORMAL, sub, code)
    return (sign | code).to(tl.uint8)


@triton.jit
def _quantize_rows(
    rows_ptr, x, head_ok, dim_ok, offs_d, HEAD_DIM: tl.constexpr, KV_TYPE: tl.constexpr
):
    """Store x ([HKV_P, D_P] float32) as quantized head rows, row h at rows_ptr[h] (uint8
    pointers; a scaled row's scale after its HEAD_DIM bytes). KV_TYPE 4: float16 keys; 5, 6:
    scaled fp8 values."""
    ok = head_ok[:, None] & dim_ok[None, :]
    dst = rows_ptr[:, None] + offs_d[None, :]
    if KV_TYPE == 4:  # float16 keys
        halves = rows_ptr.to(tl.pointer_type(tl.float16))[:, None] + offs_d[None, :]
        tl.store(halves, tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16), mask=ok)
    elif KV_TYPE == 1:
        amax = tl.max(tl.where(ok, tl.abs(x), 0.0), axis=1)
        inv = tl.where(amax > 0.0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
        r = x * inv[:, None]
        q = tl.where(r >= 0.0, tl.floor(r + 0.5), -tl.floor(0.5 - r))
        tl.store(dst, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=ok)
        scale_ptr = (rows_ptr + HEAD_DIM).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptr, amax * (1.0 / 127.0), mask=head_ok)
    elif KV_TYPE == 5 or KV_TYPE == 6:  # fp8 values scaled to the format's largest value
        if KV_TYPE == 5:
            TOP: tl.constexpr = 448.0
        else:
            TOP: tl.constexpr = 57344.0
        amax = tl.max(tl.where(ok, tl.abs(x), 0.0), axis=1)
        inv = tl.where(amax > 0.0, TOP / tl.maximum(amax, 1e-30), 0.0)
        tl.store(dst, _float_to_fp8(x * inv[:, None], KV_TYPE - 3), mask=ok)
        scale_ptr = (rows_ptr + HEAD_DIM).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptr, amax * (1.0 / TOP), mask=head_ok)
    else:
        tl.store(dst, _float_to_fp8(x, KV_TYPE), mask=ok)


@triton.jit
def _reshape_and_cache_quantized_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_stride_t,
    v_stride_t,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HKV_P: tl.constexpr,
    D_P: tl.constexpr,
    KV_TYPE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    offs_h = tl.arange(0, HKV_P)
    offs_d = tl.arange(0, D_P)
    head_ok = offs_h < NUM_KV_HEADS
    dim_ok = offs_d < HEAD_DIM
    ok = head_ok[:, None] & dim_ok[None, :]
    src = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + token.to(tl.int64) * k_stride_t + src, mask=ok, other=0.0)
    v = tl.load(v_ptr + token.to(tl.int64) * v_stride_t + src, mask=ok, other=0.0)
    rows = (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_slot
    rows = rows + offs_h * cache_stride_head
    if KV_TYPE >= 4:  # float16 keys; int8 (4) or scaled fp8 (5, 6) values
        _quantize_rows(k_cache_ptr + rows, k.to(tl.float32), head_ok, dim_ok, offs_d, HEAD_DIM, 4)
        if KV_TYPE == 4:
            _quantize_rows(
                v_cache_ptr + rows, v.to(tl.float32), head_ok, dim_ok, offs_d, HEAD_DIM, 1
            )
        else:
            _quantize_rows(
                v_cache_ptr + rows, v.to(tl.float32), head_ok, dim_ok, offs_d, HEAD_DIM, KV_TYPE
            )
    else:
        _quantize_rows(
            k_cache_ptr + rows, k.to(tl.float32), head_ok, dim_ok, offs_d, HEAD_DIM, KV_TYPE
        )
        _quantize_rows(
            v_cache_ptr + rows, v.to(tl.float32), head_ok, dim_ok, offs_d, HEAD_DIM, KV_TYPE
        )


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_stride_t,
    v_stride_t,
    cache_stride_block,
    cache_stride_slot,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: a token's K (or V), contiguous
    ROW_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padded row (a CUDA graph's spare batch slot) writes nothing
        return
    offs = tl.arange(0, ROW_PADDED)
    mask = offs < ROW
    dst = (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_slot
    k = tl.load(k_ptr + token.to(tl.int64) * k_stride_t + offs, mask=mask)
    v = tl.load(v_ptr + token.to(tl.int64) * v_stride_t + offs, mask=mask)
    tl.store(k_cache_ptr + dst + offs, k, mask=mask)
    tl.store(v_cache_ptr + dst + offs, v, mask=mask)


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (uint8 rows when quantized)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; a negative slot is skipped
    kv_type: int = 0,  # KVCacheFormat.code: 0 as it is, else quantized as it is written
) -> None:
    """Store each token's K/V at its flat slot (block * block_size + offset)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if kv_type:
        assert k.stride()[1:] == (head_dim, 1) and v.stride()[1:] == (head_dim, 1)
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
        _reshape_and_cache_quantized_kernel[(num_tokens,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            v.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            BLOCK_SIZE=k_cache.shape[1],
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HKV_P=triton.next_power_of_2(num_kv_heads),
            D_P=triton.next_power_of_2(head_dim),
            KV_TYPE=kv_type,
        )
        return
    _, block_size, cache_heads, cache_dim = k_cache.shape
    assert (cache_heads, cache_dim) == (num_kv_heads, head_dim), "cache shape mismatch"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride()[2:] == (head_dim, 1)
    assert k.stride()[1:] == (head_dim, 1) and v.stride()[1:] == (head_dim, 1)
    row = num_kv_heads * head_dim
    _reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        BLOCK_SIZE=block_size,
        ROW=row,
        ROW_PADDED=triton.next_power_of_2(row),
    )
