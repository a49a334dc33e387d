"""Triton kernels for the small layers of a GPU forward pass: RMS norm (with the residual
add fused), SiLU-and-mul, and rotary embedding of q and k in place.

In torch each of these is 3 to 10 kernels (an RMS norm alone: upcast, square, mean, add,
rsqrt, product, downcast, scale), and a decode step of a small model is made of launches,
not bytes: Qwen3-0.6B's step was ~1,700 kernels and 3.3 ms of GPU time on an H200, against
0.28 ms to read its weights. Here each layer is one launch (vLLM's custom ops do the same).

Each kernel rounds where HF's torch code rounds (to the model's dtype after each op that
torch runs in it), so bfloat16 results equal HF's eager ones but for the order of the norm's
sum; floating-point contraction (a * b + c as one FMA) is turned off at launch for the
same reason. Under ``TRITON_INTERPRET=1`` they run on CPU tensors (the tests' way in CI).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# HF's order, not the fastest: no a * b + c fused into one rounding.
EXACT = {"enable_fp_fusion": False}


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x (float32) rounded to dtype, to nearest even, and kept in float32: torch's rounding
    after an op it runs in dtype. bfloat16 by its bits: the interpreter's cast truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """x (float32) in dtype, rounded to nearest even (the interpreter's own cast truncates)."""
    return _round(x, dtype).to(dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    inner,  # rows per outer index: x is [outer, inner, N] with strides (sx_outer, sx_inner, 1)
    sx_outer,
    sx_inner,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    src = (row // inner).to(tl.int64) * sx_outer + (row % inner).to(tl.int64) * sx_inner
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + src + offs, mask=mask, other=0.0).to(tl.float32)
    dst = row.to(tl.int64) * N + offs  # residual and out are contiguous [rows, N]
    if HAS_RESIDUAL:
        # HF: residual + hidden in the model's dtype; the sum is the new residual stream.
        r = tl.load(residual_ptr + dst, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dtype)
        tl.store(residual_ptr + dst, _cast(x, dtype), mask=mask)
    variance = tl.sum(x * x, axis=0) / N
    normed = _round(x * tl.rsqrt(variance + eps), dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, _cast(w * normed, dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """weight * norm(x) over the last dimension, x [..., N] with its last dimension contiguous
    (q or k heads may be a view of the fused qkv rows). With residual (contiguous, x's
    shape), residual becomes x + residual first, in place, and the norm is taken of it."""
    n = x.shape[-1]
    rows = x.view(-1, n) if x.dim() != 3 else x
    outer, inner = (rows.shape[0], 1) if rows.dim() == 2 else rows.shape[:2]
    strides = (rows.stride(0), 0) if rows.dim() == 2 else (rows.stride(0), rows.stride(1))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _rms_norm_kernel[(outer * inner,)](
        x,
        residual if residual is not None else out,  # not read without a residual
        weight,
        out,
        inner,
        *strides,
        eps,
        N=n,
        BLOCK=triton.next_power_of_2(n),
        HAS_RESIDUAL=residual is not None,
        num_warps=4 if n <= 4096 else 8,
        **EXACT,
    )
    return out


def takes_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether rms_norm takes these: 2-D or 3-D rows with a contiguous last dimension (any
    other shape contiguous), a contiguous weight, a contiguous residual of x's shape."""
    if x.stride(-1) != 1 or not weight.is_contiguous():
        return False
    if x.dim() not in (2, 3) and not x.is_contiguous():
        return False
    return residual is None or (
        residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, sx, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * sx + D + offs, mask=mask, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)  # HF: silu, then the product
    tl.store(out_ptr + row * D + offs, _cast(silu * up, dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] [T, 2d] (rows may be strided) -> [T, d]."""
    d = x.shape[-1] // 2
    rows = x.view(-1, 2 * d) if x.dim() != 2 else x
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
        rows, out, rows.stride(0), D=d, BLOCK=block, num_warps=4, **EXACT
    )
    return out


@triton.jit
def _rotate_heads(ptr, stride_h, num_heads, cos1, sin1, cos2, sin2, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Turns one token's heads in place: [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin],
    each product and the sum rounded to the dtype as HF's x * cos + rotate_half(x) * sin."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    first = ptr + heads * stride_h + dims
    dtype = ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    a = _round(x1 * cos1, dtype)
    b = _round(-x2 * sin1, dtype)
    c = _round(x2 * cos2, dtype)
    d = _round(x1 * sin2, dtype)
    tl.store(first, _cast(a + b, dtype), mask=mask)
    tl.store(first + HALF, _cast(c + d, dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    dtype = q_ptr.dtype.element_ty
    row = tl.load(positions_ptr + token).to(tl.int64) * (2 * HALF)
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = dims < HALF
    # HF casts the float32 tables to the model's dtype before the products.
    cos1 = _round(tl.load(cos_ptr + row + dims, mask=mask, other=0.0), dtype)
    sin1 = _round(tl.load(sin_ptr + row + dims, mask=mask, other=0.0), dtype)
    cos2 = _round(tl.load(cos_ptr + row + HALF + dims, mask=mask, other=0.0), dtype)
    sin2 = _round(tl.load(sin_ptr + row + HALF + dims, mask=mask, other=0.0), dtype)
    t = token.to(tl.int64)
    _rotate_heads(q_ptr + t * sq_t, sq_h, num_q_heads, cos1, sin1, cos2, sin2,
                  HALF, BLOCK_H, BLOCK_D)  # fmt: skip
    _rotate_heads(k_ptr + t * sk_t, sk_h, num_k_heads, cos1, sin1, cos2, sin2,
                  HALF, BLOCK_H, BLOCK_D)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D], D contiguous (a view of the fused qkv rows will do)
    k: torch.Tensor,  # [T, Hkv, D] (Hkv may be 0)
    cos: torch.Tensor,  # [positions, D] float32, contiguous
    sin: torch.Tensor,
) -> None:
    """Rotates q and k in place (rotate-half layout, the whole head)."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        num_q_heads,
        k.shape[1],
        HALF=half,
        BLOCK_H=triton.next_power_of_2(max(num_q_heads, k.shape[1])),
        BLOCK_D=triton.next_power_of_2(half),
        num_warps=4,
        **EXACT,
    )
