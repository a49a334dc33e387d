"""Causal short convolutions over per-request conv states in Triton (the GPU's; under
``TRITON_INTERPRET=1`` on CPU tensors, the tests' way in CI): LFM2's gated one and Mamba-2's
with a bias and SiLU. Semantics: conv_kernels.py.

One program per (request, block of channels) walks the request's tokens in order; each
output reads its K inputs from the chunk's rows or, before the chunk, from the state, and
the program leaves the chunk's last K - 1 inputs in the state. Arithmetic in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _input(rows, row_stride, st, c, mask, u, start, dim, K: tl.constexpr, GATED: tl.constexpr):
    """The convolution's input at positions u (a vector of one value): B * x (GATED) or x
    from the chunk's rows, or before start, from the state."""
    in_chunk = u >= start
    if GATED:
        b = tl.load(rows + u * row_stride + c, mask=mask & in_chunk, other=0.0).to(tl.float32)
        x = tl.load(rows + u * row_stride + 2 * dim + c, mask=mask & in_chunk, other=0.0)
        v = b * x.to(tl.float32)
    else:
        v = tl.load(rows + u * row_stride + c, mask=mask & in_chunk, other=0.0).to(tl.float32)
    s = tl.load(st + (K - 1 - start + u), mask=mask & (u < start), other=0.0).to(tl.float32)
    return tl.where(in_chunk, v, s)


@triton.jit
def _short_conv_kernel(
    rows,
    row_stride,
    weight,
    bias,
    state,
    slots,
    qsl,
    out,
    dim,
    HAS_QSL: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < dim
    if HAS_QSL:
        start = tl.load(qsl + r).to(tl.int64)
        end = tl.load(qsl + r + 1).to(tl.int64)
    else:
        start = r.to(tl.int64)
        end = start + 1
    slot = tl.load(slots + r)
    st = state + slot * dim * (K - 1) + c * (K - 1)
    zero = tl.full([BLOCK], 0, tl.int64)  # positions as vectors, for the masks
    for t in range(start, end):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias + c, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            v = _input(rows, row_stride, st, c, mask, zero + t - (K - 1) + j, start, dim, K, GATED)
            acc += tl.load(weight + c * K + j, mask=mask, other=0.0).to(tl.float32) * v
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        if GATED:
            acc *= tl.load(rows + t * row_stride + dim + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + t * dim + c, acc.to(out.dtype.element_ty), mask=mask)
    # The new state: the last K - 1 inputs. Entry j reads old entry j + (end - start) >= j
    # when it comes from the state, so writing in order never clobbers one still to read.
    for j in tl.static_range(K - 1):
        v = _input(rows, row_stride, st, c, mask, zero + end - (K - 1) + j, start, dim, K, GATED)
        tl.store(st + j, v.to(state.dtype.element_ty), mask=mask)


def _launch(rows, weight, bias, conv_state, slots, query_start_loc, gated, silu):
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    dim, k = weight.shape
    out = rows.new_empty(rows.shape[0], dim)
    num_reqs = slots.shape[0]
    if num_reqs == 0:
        return out
    block = min(256, triton.next_power_of_2(dim))
    has_qsl = query_start_loc is not None
    _short_conv_kernel[(num_reqs, triton.cdiv(dim, block))](
        rows,
        rows.stride(0),
        weight,
        bias if bias is not None else weight,
        conv_state,
        slots,
        query_start_loc if has_qsl else slots,
        out,
        dim,
        HAS_QSL=has_qsl,
        GATED=gated,
        HAS_BIAS=bias is not None,
        SILU=silu,
        K=k,
        BLOCK=block,
    )
    return out


def gated_short_conv_triton(
    bcx: torch.Tensor,  # [T, 3D], B | C | x
    weight: torch.Tensor,  # [D, K] contiguous
    conv_state: torch.Tensor,  # [slots, D, K - 1] contiguous, updated in place
    slots: torch.Tensor,  # [B] int64
    query_start_loc: torch.Tensor | None,  # [B + 1] (None: row i is request i)
) -> torch.Tensor:
    return _launch(bcx, weight, None, conv_state, slots, query_start_loc, True, False)


def causal_conv1d_triton(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    silu: bool = True,
) -> torch.Tensor:
    return _launch(x, weight, bias, conv_state, slots, query_start_loc, False, silu)
