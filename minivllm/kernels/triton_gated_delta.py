"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) in Triton for the GPU, with
the gating (g, beta from the raw a/b projections) and the q/k L2 norms fused; the rule,
its two forms and the layouts are gated_delta_torch.py's.

Both kernels take a flat batch of sequences and run one program per (sequence, value head,
block of BV value columns), the state block [Dk, BV] held in registers and written back to
the sequence's slot at the end:
- ``recurrent``: token by token (decode steps: one token a sequence, CUDA-graph friendly);
- ``chunked``: BT tokens at a time, each chunk a few BT x BT and BT x D products (the UT
  transform: the unit lower-triangular system solved by forward substitution in
  registers), so a prompt takes len / BT serial steps instead of len.
A decode row in a mixed batch is a chunk of one token. Products run in IEEE float32 (no
TF32). Under ``TRITON_INTERPRET=1`` both run on CPU tensors (the tests' way in CI).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

L2_EPS = 1e-6
CHUNK = 16  # BT: tl.dot takes no dimension under 16


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _sequence(qsl_ptr, slots_ptr, init_ptr, HAS_INIT_FLAGS: tl.constexpr):
    """(first token, end, state slot, whether the state is read) of this program's sequence."""
    seq = tl.program_id(0)
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq)
    read = slot >= 0
    if HAS_INIT_FLAGS:
        read = read & (tl.load(init_ptr + seq) != 0)
    return start, end, slot, read


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
    qsl_ptr, slots_ptr, init_ptr, out_ptr,
    sq, sk, sv, sab, HV, group, scale,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1)
    kh = h // group
    start, end, slot, read = _sequence(qsl_ptr, slots_ptr, init_ptr, HAS_INIT_FLAGS)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    # A padded row's slot (-1) reads slot 0 and writes nothing.
    s_ptrs = state_ptr + (tl.maximum(slot, 0).to(tl.int64) * HV + h) * DK * DV
    s_ptrs += offs_k[:, None] * DV + offs_v[None, :]
    S = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    S = tl.where(read, S, 0.0)
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    for i in range(0, end - start):
        t64 = start.to(tl.int64) + i
        q = tl.load(q_ptr + t64 * sq + kh * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64 * sk + kh * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64 * sv + h * DV + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        q = q * (scale / tl.sqrt(tl.sum(q * q, 0) + L2_EPS))
        k = k / tl.sqrt(tl.sum(k * k, 0) + L2_EPS)
        a = tl.load(a_ptr + t64 * sab + h).to(tl.float32)
        b = tl.load(b_ptr + t64 * sab + h).to(tl.float32)
        decay = tl.exp(A * _softplus(a + bias))
        beta = 1.0 / (1.0 + tl.exp(-b))
        S = S * decay
        delta = (v - tl.sum(S * k[:, None], 0)) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(out_ptr + (t64 * HV + h) * DV + offs_v, o.to(out_ptr.dtype.element_ty),
                 mask=mask_v)  # fmt: skip
    if slot >= 0:
        tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s)


@triton.jit
def _chunked_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
    qsl_ptr, slots_ptr, init_ptr, out_ptr,
    sq, sk, sv, sab, HV, group, scale,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1)
    kh = h // group
    start, end, slot, read = _sequence(qsl_ptr, slots_ptr, init_ptr, HAS_INIT_FLAGS)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    # A padded row's slot (-1) reads slot 0 and writes nothing.
    s_ptrs = state_ptr + (tl.maximum(slot, 0).to(tl.int64) * HV + h) * DK * DV
    s_ptrs += offs_k[:, None] * DV + offs_v[None, :]
    S = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    S = tl.where(read, S, 0.0)
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    rows = tl.arange(0, BT)
    lower = rows[:, None] >= rows[None, :]  # causal, with the diagonal
    strict = rows[:, None] > rows[None, :]
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    for c0 in range(start, end, BT):
        t = (c0 + rows).to(tl.int64)
        live = t < end
        mk = live[:, None] & mask_k[None, :]
        q = tl.load(q_ptr + t[:, None] * sq + kh * DK + offs_k[None, :], mask=mk, other=0.0)
        k = tl.load(k_ptr + t[:, None] * sk + kh * DK + offs_k[None, :], mask=mk, other=0.0)
        v = tl.load(v_ptr + t[:, None] * sv + h * DV + offs_v[None, :],
                    mask=live[:, None] & mask_v[None, :], other=0.0).to(tl.float32)  # fmt: skip
        q, k = q.to(tl.float32), k.to(tl.float32)
        q = q * (scale / tl.sqrt(tl.sum(q * q, 1) + L2_EPS))[:, None]
        k = k / tl.sqrt(tl.sum(k * k, 1) + L2_EPS)[:, None]
        a = tl.load(a_ptr + t * sab + h, mask=live, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + t * sab + h, mask=live, other=0.0).to(tl.float32)
        g = tl.where(live, A * _softplus(a + bias), 0.0)  # padding: no decay, no write
        beta = tl.where(live, 1.0 / (1.0 + tl.exp(-b)), 0.0)
        cum = tl.cumsum(g, 0)
        decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0))
        decay = tl.where(lower, decay, 0.0)
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        system = tl.where(strict, beta[:, None] * kk * decay, 0.0)
        # inv = (I + system)^-1 row by row: inv_i = e_i - sum_j<i system_ij inv_j.
        inv = eye
        for i in tl.static_range(1, BT):
            row = tl.sum(tl.where(rows[:, None] == i, system, 0.0), 0)  # system[i, :]
            new = tl.sum(row[:, None] * inv, 0)
            inv = tl.where(rows[:, None] == i, eye - new[None, :], inv)
        u = tl.dot(inv, v * beta[:, None], input_precision="ieee")
        w = tl.dot(inv, k * (beta * tl.exp(cum))[:, None], input_precision="ieee")
        v_new = u - tl.dot(w, S, input_precision="ieee")
        attn = tl.where(lower, tl.dot(q, tl.trans(k), input_precision="ieee") * decay, 0.0)
        o = tl.dot(q * tl.exp(cum)[:, None], S, input_precision="ieee")
        o += tl.dot(attn, v_new, input_precision="ieee")
        out_ptrs = out_ptr + (t[:, None] * HV + h) * DV + offs_v[None, :]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=live[:, None] & mask_v[None, :])
        last = tl.sum(g, 0)  # the chunk's whole log decay (padding adds 0)
        k_to_end = k * tl.exp(last - cum)[:, None]
        S = S * tl.exp(last) + tl.dot(tl.trans(k_to_end), v_new, input_precision="ieee")
    if slot >= 0:
        tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s)


def gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk], heads contiguous, rows may be strided
    k: torch.Tensor,  # [T, Hk, Dk], the same
    v: torch.Tensor,  # [T, Hv, Dv], the same
    a: torch.Tensor,  # [T, Hv] raw projections
    b: torch.Tensor,  # [T, Hv], rows as a's
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    state: torch.Tensor,  # [num_slots, Hv, Dk, Dv], updated in place
    query_start_loc: torch.Tensor,  # [B + 1] int
    state_slots: torch.Tensor,  # [B] int (negative: a padded row, skipped)
    has_initial_state: torch.Tensor | None = None,  # [B]; None: all have one
    chunked: bool = True,  # False: the recurrent kernel (decode steps)
) -> torch.Tensor:
    """gated_delta_torch.gated_delta_rule with the gating fused: out [T, Hv, Dv] in v's dtype."""
    num_tokens, num_k_heads, head_k = q.shape
    _, num_v_heads, head_v = v.shape
    out = torch.empty(num_tokens, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    num_seqs = state_slots.numel()
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_k = triton.next_power_of_2(max(head_k, 16))
    block_v = min(64 if chunked else 32, triton.next_power_of_2(max(head_v, 16)))
    grid = (num_seqs, num_v_heads, triton.cdiv(head_v, block_v))
    flags = has_initial_state if has_initial_state is not None else state_slots
    args = (q, k, v, a, b, A_log, dt_bias, state, query_start_loc, state_slots, flags, out,
            q.stride(0), k.stride(0), v.stride(0), a.stride(0), num_v_heads,
            num_v_heads // num_k_heads, head_k**-0.5)  # fmt: skip
    meta = dict(DK=head_k, DV=head_v, BK=block_k, BV=block_v,
                HAS_INIT_FLAGS=has_initial_state is not None)  # fmt: skip
    if chunked:
        _chunked_kernel[grid](*args, **meta, BT=CHUNK, num_warps=4)
    else:
        _recurrent_kernel[grid](*args, **meta, num_warps=4)
    return out
