"""Mamba-2's selective scan over per-request SSM states in Triton (the GPU's; under
``TRITON_INTERPRET=1`` on CPU tensors, the tests' way in CI). Semantics: ssm_kernels.py.

One program per (request, head, block of head_dim rows) holds that block of the state,
[BLOCK_P, N], in registers and walks the request's tokens in order (the recurrent form:
a prompt's tokens one after another, a decode row once), then writes the state back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mamba2_scan_kernel(
    x,
    x_stride,
    dt,
    dt_stride,
    A,
    B,
    C,
    bc_stride,
    D,
    dt_bias,
    dt_min,
    dt_max,
    state,
    slots,
    qsl,
    out,
    heads,
    head_dim,
    per_group,
    n,
    HAS_QSL: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    k = tl.arange(0, BLOCK_N)
    p_mask = p < head_dim
    k_mask = k < n
    if HAS_QSL:
        start = tl.load(qsl + r).to(tl.int64)
        end = tl.load(qsl + r + 1).to(tl.int64)
    else:
        start = r.to(tl.int64)
        end = start + 1
    g = h // per_group
    slot = tl.load(slots + r)
    st_ptr = state + ((slot * heads + h) * head_dim + p[:, None]) * n + k[None, :]
    mask2 = p_mask[:, None] & k_mask[None, :]
    st = tl.load(st_ptr, mask=mask2, other=0.0).to(tl.float32)
    a = tl.load(A + h).to(tl.float32)
    skip = tl.load(D + h).to(tl.float32)
    bias = tl.load(dt_bias + h).to(tl.float32)
    for t in range(start, end):
        d = tl.load(dt + t * dt_stride + h).to(tl.float32) + bias
        d = tl.where(d > 20.0, d, tl.log(1.0 + tl.exp(d)))
        d = tl.minimum(tl.maximum(d, dt_min), dt_max)
        xt = tl.load(x + t * x_stride + h * head_dim + p, mask=p_mask, other=0.0).to(tl.float32)
        bt = tl.load(B + t * bc_stride + g * n + k, mask=k_mask, other=0.0).to(tl.float32)
        ct = tl.load(C + t * bc_stride + g * n + k, mask=k_mask, other=0.0).to(tl.float32)
        st = st * tl.exp(d * a) + (d * xt)[:, None] * bt[None, :]
        y = tl.sum(st * ct[None, :], axis=1) + skip * xt
        tl.store(out + t * heads * head_dim + h * head_dim + p, y.to(out.dtype.element_ty), p_mask)
    tl.store(st_ptr, st.to(state.dtype.element_ty), mask=mask2)


def mamba2_scan_triton(
    x, dt, A, B, C, D, dt_bias, ssm_state, slots, query_start_loc, dt_limit=(0.0, float("inf"))
) -> torch.Tensor:
    heads = A.shape[0]
    _, _, head_dim, n = ssm_state.shape
    if B.stride() != C.stride() or B.stride(1) != 1 or x.stride(1) != 1 or dt.stride(1) != 1:
        x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    out = x.new_empty(x.shape[0], heads * head_dim)
    num_reqs = slots.shape[0]
    if num_reqs == 0:
        return out
    block_p = min(16, triton.next_power_of_2(head_dim))
    has_qsl = query_start_loc is not None
    groups = B.shape[1] // n
    _mamba2_scan_kernel[(num_reqs, heads, triton.cdiv(head_dim, block_p))](
        x,
        x.stride(0),
        dt,
        dt.stride(0),
        A,
        B,
        C,
        B.stride(0),
        D,
        dt_bias,
        float(dt_limit[0]),
        float(min(dt_limit[1], 3.0e38)),
        ssm_state,
        slots,
        query_start_loc if has_qsl else slots,
        out,
        heads,
        head_dim,
        heads // groups,
        n,
        HAS_QSL=has_qsl,
        BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(n),
    )
    return out
