"""Mamba-2's selective state-space scan over a flat batch with per-request SSM states: the
plain-torch references (the recurrence itself, and the chunked SSD form prompts take in
torch), the C kernel for the CPU (ssm_kernels.c) and the dispatch to Triton's
(triton_ssm.py) on a GPU.

``mamba2_scan(x, dt, A, B, C, D, dt_bias, ssm_state, slots, query_start_loc, dt_limit)``:
x [T, H * P], dt [T, H] (before its bias and softplus), B and C [T, G * N], A, D and
dt_bias [H]; request i's rows are [query_start_loc[i], query_start_loc[i + 1]) (None: a
decode step, request i is row i) and its state is ssm_state[slots[i]], [H, P, N], updated
in place. Returns y [T, H * P] (D's skip connection included, no gate).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F

from minivllm.kernels import _takes_triton_layers, cpu_kernels

_SOURCE = os.path.join(os.path.dirname(__file__), "ssm_kernels.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
# Prompt chunks of the torch SSD form (HF's mamba_chunk_size is 256).
SSD_CHUNK = 64


@functools.cache
def load_ssm_kernels() -> ctypes.CDLL | None:
    """The C library, or None when it cannot be built (no C compiler): torch then runs."""
    lib = cpu_kernels.compile_library(_SOURCE, _FLAGS, "using torch for the Mamba-2 scan")
    if lib is None:
        return None
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.mamba2_scan_f32.restype = None
    lib.mamba2_scan_f32.argtypes = (
        [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, f32, f32, ptr, ptr, ptr]
        + [i64] * 5
        + [ptr]
    )
    lib.gated_rms_norm_f32.restype = None
    lib.gated_rms_norm_f32.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, f32, ptr]
    cpu_kernels.attach_slot_twins(lib, ["mamba2_scan_f32", "gated_rms_norm_f32"])
    return lib


def _rows(query_start_loc: torch.Tensor | None, num_reqs: int) -> list[int]:
    if query_start_loc is None:
        return list(range(num_reqs + 1))
    return query_start_loc.tolist()


def _expand_groups(t: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """[L, G * N] -> [L, H, N]: each head reads its group's."""
    t = t.reshape(t.shape[0], groups, -1)
    return t.repeat_interleave(heads // groups, dim=1)


def mamba2_scan_reference(
    x, dt, A, B, C, D, dt_bias, ssm_state, slots, query_start_loc, dt_limit=(0.0, float("inf"))
) -> torch.Tensor:
    """The recurrence, one token at a time (any float dtype; float64 in the tests)."""
    heads = A.shape[0]
    _, _, head_dim, n = ssm_state.shape
    groups = B.shape[-1] // n
    out = torch.empty(x.shape[0], heads * head_dim, dtype=x.dtype, device=x.device)
    starts = _rows(query_start_loc, slots.shape[0])
    for i, slot in enumerate(slots.tolist()):
        state = ssm_state[slot].to(x.dtype)
        for t in range(starts[i], starts[i + 1]):
            d = F.softplus(dt[t] + dt_bias).clamp(dt_limit[0], dt_limit[1])  # [H]
            xt = x[t].reshape(heads, head_dim)
            bt = _expand_groups(B[t : t + 1], heads, groups)[0]  # [H, N]
            ct = _expand_groups(C[t : t + 1], heads, groups)[0]
            state = (
                state * torch.exp(d * A)[:, None, None]
                + (d[:, None] * xt)[..., None] * bt[:, None, :]
            )
            out[t] = ((state * ct[:, None, :]).sum(-1) + D[:, None] * xt).reshape(-1)
        ssm_state[slot] = state.to(ssm_state.dtype)
    return out


def mamba2_scan_chunked(
    x, dt, A, B, C, D, dt_bias, ssm_state, slots, query_start_loc, dt_limit=(0.0, float("inf"))
) -> torch.Tensor:
    """The chunked (SSD) form: within a chunk of SSD_CHUNK tokens the outputs are one masked
    product (a decay-weighted attention of C over B), between chunks the state carries."""
    heads = A.shape[0]
    _, _, head_dim, n = ssm_state.shape
    groups = B.shape[-1] // n
    out = torch.empty(x.shape[0], heads * head_dim, dtype=x.dtype, device=x.device)
    starts = _rows(query_start_loc, slots.shape[0])
    for i, slot in enumerate(slots.tolist()):
        state = ssm_state[slot].to(torch.float32 if x.dtype != torch.float64 else x.dtype)
        for c0 in range(starts[i], starts[i + 1], SSD_CHUNK):
            c1 = min(c0 + SSD_CHUNK, starts[i + 1])
            xs = x[c0:c1].reshape(c1 - c0, heads, head_dim).to(state.dtype)
            d = F.softplus(dt[c0:c1].to(state.dtype) + dt_bias).clamp(dt_limit[0], dt_limit[1])
            bs = _expand_groups(B[c0:c1], heads, groups).to(state.dtype)  # [l, H, N]
            cs = _expand_groups(C[c0:c1], heads, groups).to(state.dtype)
            cum = (d * A).cumsum(0)  # [l, H]: log decay from the chunk's start
            seg = cum[:, None, :] - cum[None, :, :]  # [l, l, H]: from j to i
            causal = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=x.device).tril()
            decay = torch.exp(seg.masked_fill(~causal[..., None], float("-inf")))
            scores = torch.einsum("ihn,jhn->ijh", cs, bs) * decay
            y = torch.einsum("ijh,jhp->ihp", scores, xs * d[..., None])
            y += torch.einsum("ihn,hpn->ihp", cs, state) * torch.exp(cum)[..., None]
            last = torch.exp(cum[-1][None] - cum)  # [l, H]: decay from j to the chunk's end
            state = state * torch.exp(cum[-1])[:, None, None] + torch.einsum(
                "jh,jhp,jhn->hpn", last * d, xs, bs
            )
            y += D[:, None] * xs
            out[c0:c1] = y.reshape(c1 - c0, -1).to(out.dtype)
        ssm_state[slot] = state.to(ssm_state.dtype)
    return out


def mamba2_scan(
    x, dt, A, B, C, D, dt_bias, ssm_state, slots, query_start_loc, dt_limit=(0.0, float("inf"))
) -> torch.Tensor:
    """The C kernel on float32 host tensors, Triton's on a GPU, else the torch SSD form."""
    args = (x, dt, A, B, C, D, dt_bias, ssm_state, slots, query_start_loc, dt_limit)
    if _takes_triton_layers(x.device.type):
        from minivllm.kernels.triton_ssm import mamba2_scan_triton

        return mamba2_scan_triton(*args)
    lib = load_ssm_kernels() if cpu_kernels.is_cpu_f32(x, dt, B, ssm_state) else None
    if lib is None:
        return mamba2_scan_chunked(*args)
    heads = A.shape[0]
    _, _, head_dim, n = ssm_state.shape
    if B.stride() != C.stride() or B.stride(1) != 1 or x.stride(1) != 1 or dt.stride(1) != 1:
        x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    if query_start_loc is not None and query_start_loc.dtype != torch.int32:
        query_start_loc = query_start_loc.to(torch.int32)
    out = x.new_empty(x.shape[0], heads * head_dim)
    cpu_kernels.launch(
        lib.mamba2_scan_f32,
        x.data_ptr(),
        x.stride(0),
        dt.data_ptr(),
        dt.stride(0),
        A.data_ptr(),
        B.data_ptr(),
        C.data_ptr(),
        B.stride(0),
        D.data_ptr(),
        dt_bias.data_ptr(),
        float(dt_limit[0]),
        float(min(dt_limit[1], 3.0e38)),
        ssm_state.data_ptr(),
        slots.data_ptr(),
        query_start_loc.data_ptr() if query_start_loc is not None else None,
        slots.shape[0],
        heads,
        head_dim,
        B.shape[1] // n,
        n,
        out.data_ptr(),
    )
    return out


def gated_rms_norm_reference(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """HF's GraniteMoeHybridRMSNormGated: y * silu(z) in float32, normalised over each
    group of group_size values, cast back to y's dtype, times weight."""
    dtype = y.dtype
    wide = torch.promote_types(dtype, torch.float32)  # float64 stays float64 (the tests')
    v = y.to(wide) * F.silu(z.to(wide))
    grouped = v.view(v.shape[0], -1, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view_as(v).to(dtype)


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """The C kernel on float32 host tensors (z's rows may be strided), else the reference."""
    lib = load_ssm_kernels() if cpu_kernels.is_cpu_f32(y, z, weight) else None
    if lib is None:
        return gated_rms_norm_reference(y, z, weight, group_size, eps)
    if y.stride(1) != 1 or y.stride(0) != y.shape[1]:
        y = y.contiguous()
    if z.stride(1) != 1:
        z = z.contiguous()
    out = torch.empty_like(y)
    rows, dim = y.shape
    cpu_kernels.launch(
        lib.gated_rms_norm_f32,
        y.data_ptr(),
        z.data_ptr(),
        z.stride(0),
        weight.data_ptr(),
        rows,
        dim,
        group_size,
        eps,
        out.data_ptr(),
    )
    return out
