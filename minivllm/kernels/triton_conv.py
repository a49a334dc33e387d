"""The gated short convolution over per-request conv states in Triton (the GPU's; under
``TRITON_INTERPRET=1`` on CPU tensors, the tests' way in CI). Semantics: conv_kernels.py.

One program per (request, block of channels) walks the request's tokens in order; each
output reads its K inputs from the chunk's rows or, before the chunk, from the state, and
the program leaves the chunk's last K - 1 inputs in the state. Arithmetic in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_short_conv_kernel(
    bcx,
    row_stride,
    weight,
    state,
    slots,
    qsl,
    out,
    dim,
    HAS_QSL: tl.constexpr,
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
    for t in range(start, end):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            # The input's position (a vector, for the masks); before start: in the state.
            u = tl.full([BLOCK], 0, tl.int64) + t - (K - 1) + j
            in_chunk = u >= start
            b = tl.load(bcx + u * row_stride + c, mask=mask & in_chunk, other=0.0)
            x = tl.load(bcx + u * row_stride + 2 * dim + c, mask=mask & in_chunk, other=0.0)
            s = tl.load(st + (K - 1 - start + u), mask=mask & (u < start), other=0.0)
            v = tl.where(in_chunk, b.to(tl.float32) * x.to(tl.float32), s.to(tl.float32))
            acc += tl.load(weight + c * K + j, mask=mask, other=0.0).to(tl.float32) * v
        gate = tl.load(bcx + t * row_stride + dim + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + t * dim + c, (gate * acc).to(out.dtype.element_ty), mask=mask)
    # The new state: the last K - 1 inputs. Entry j reads old entry j + (end - start) >= j
    # when it comes from the state, so writing in order never clobbers one still to read.
    for j in tl.static_range(K - 1):
        u = tl.full([BLOCK], 0, tl.int64) + end - (K - 1) + j
        in_chunk = u >= start
        b = tl.load(bcx + u * row_stride + c, mask=mask & in_chunk, other=0.0)
        x = tl.load(bcx + u * row_stride + 2 * dim + c, mask=mask & in_chunk, other=0.0)
        s = tl.load(st + (K - 1 - start + u), mask=mask & (u < start), other=0.0)
        v = tl.where(in_chunk, b.to(tl.float32) * x.to(tl.float32), s.to(tl.float32))
        tl.store(st + j, v.to(state.dtype.element_ty), mask=mask)


def gated_short_conv_triton(
    bcx: torch.Tensor,  # [T, 3D], B | C | x
    weight: torch.Tensor,  # [D, K] contiguous
    conv_state: torch.Tensor,  # [slots, D, K - 1] contiguous, updated in place
    slots: torch.Tensor,  # [B] int64
    query_start_loc: torch.Tensor | None,  # [B + 1] (None: row i is request i)
) -> torch.Tensor:
    if bcx.stride(1) != 1:
        bcx = bcx.contiguous()
    dim, k = weight.shape
    out = bcx.new_empty(bcx.shape[0], dim)
    num_reqs = slots.shape[0]
    if num_reqs == 0:
        return out
    block = min(256, triton.next_power_of_2(dim))
    has_qsl = query_start_loc is not None
    _gated_short_conv_kernel[(num_reqs, triton.cdiv(dim, block))](
        bcx,
        bcx.stride(0),
        weight,
        conv_state,
        slots,
        query_start_loc if has_qsl else slots,
        out,
        dim,
        HAS_QSL=has_qsl,
        K=k,
        BLOCK=block,
    )
    return out
