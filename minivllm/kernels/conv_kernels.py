"""Causal short convolutions over a per-request conv state (LFM2's gated short conv, and
Mamba-2's conv with a bias and SiLU, ``causal_conv1d``): the plain-torch references, the C
kernels for the CPU (conv_kernels.c, built as cpu_kernels.py builds its own) and the
dispatch between them and Triton's (triton_conv.py).

``gated_short_conv(bcx, weight, conv_state, slots, query_start_loc)``: bcx [T, 3D] holds
B | C | x per token; request i's tokens are rows [query_start_loc[i], query_start_loc[i+1])
(None: a decode step, request i is row i) and its state is conv_state[slots[i]], [D, K-1],
the last K - 1 values of v = B * x before its first token. Returns y = C * conv(v) [T, D]
and leaves each request's last K - 1 values of v in its state (in place).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from minivllm.kernels import _takes_triton_layers, cpu_kernels

_SOURCE = os.path.join(os.path.dirname(__file__), "conv_kernels.c")
# cpu_kernels' flags: -ffast-math lets a decode step's SiLU run in vectors (libmvec's expf)
_FLAGS = list(cpu_kernels._FLAGS)


@functools.cache
def load_conv_kernels() -> ctypes.CDLL | None:
    """The C library, or None when it cannot be built (no C compiler): torch then runs."""
    lib = cpu_kernels.compile_library(_SOURCE, _FLAGS, "using torch for short convolutions")
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gated_short_conv_f32.restype = None
    lib.gated_short_conv_f32.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ptr]
    lib.causal_conv1d_f32.restype = None
    lib.causal_conv1d_f32.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr] + [i64] * 4 + [ptr]
    cpu_kernels.attach_slot_twins(lib, ["gated_short_conv_f32", "causal_conv1d_f32"])
    return lib


def gated_short_conv_reference(
    bcx: torch.Tensor,
    weight: torch.Tensor,  # [D, K]
    conv_state: torch.Tensor,  # [slots, D, K - 1], updated in place
    slots: torch.Tensor,  # [B] int64
    query_start_loc: torch.Tensor | None,  # [B + 1] (None: row i is request i)
) -> torch.Tensor:
    """The definition, one request at a time (any float dtype; float64 in the tests)."""
    dim, k = weight.shape
    b, c, x = bcx.split(dim, dim=-1)
    v = b * x
    out = torch.empty_like(v)
    starts = (
        query_start_loc.tolist() if query_start_loc is not None else list(range(len(slots) + 1))
    )
    for i, slot in enumerate(slots.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        full = torch.cat([conv_state[slot].transpose(0, 1).to(v.dtype), v[start:end]])
        windows = full.unfold(0, k, 1)  # [L, D, K]: the K inputs each output reads
        out[start:end] = (windows * weight.to(v.dtype)).sum(-1)
        if k > 1:
            conv_state[slot] = full[-(k - 1) :].transpose(0, 1).to(conv_state.dtype)
    return c * out


def gated_short_conv(
    bcx: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor | None,
) -> torch.Tensor:
    """The C kernel on float32 host tensors, Triton's on a GPU, else the reference."""
    if _takes_triton_layers(bcx.device.type):
        from minivllm.kernels.triton_conv import gated_short_conv_triton

        return gated_short_conv_triton(bcx, weight, conv_state, slots, query_start_loc)
    lib = load_conv_kernels() if cpu_kernels.is_cpu_f32(bcx, weight, conv_state) else None
    if lib is None:
        return gated_short_conv_reference(bcx, weight, conv_state, slots, query_start_loc)
    if bcx.stride(1) != 1:
        bcx = bcx.contiguous()
    dim, k = weight.shape
    if query_start_loc is not None and query_start_loc.dtype != torch.int32:
        query_start_loc = query_start_loc.to(torch.int32)
    out = bcx.new_empty(bcx.shape[0], dim)
    cpu_kernels.launch(
        lib.gated_short_conv_f32,
        bcx.data_ptr(),
        bcx.stride(0),
        weight.data_ptr(),
        conv_state.data_ptr(),
        slots.data_ptr(),
        query_start_loc.data_ptr() if query_start_loc is not None else None,
        slots.shape[0],
        dim,
        k,
        out.data_ptr(),
    )
    return out


def causal_conv1d_reference(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    conv_state: torch.Tensor,  # [slots, D, K - 1], updated in place
    slots: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """Mamba-2's convolution (HF's causal_conv1d_fn / _update): conv(x) + bias, then SiLU."""
    dim, k = weight.shape
    ones = torch.ones_like(x)
    # The gated form with B = 1 and C = 1 is the plain convolution.
    out = gated_short_conv_reference(
        torch.cat([ones, ones, x], -1), weight, conv_state, slots, query_start_loc
    )
    if bias is not None:
        out = out + bias.to(out.dtype)
    return torch.nn.functional.silu(out) if silu else out


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    silu: bool = True,
) -> torch.Tensor:
    """The C kernel on float32 host tensors, Triton's on a GPU, else the reference."""
    if _takes_triton_layers(x.device.type):
        from minivllm.kernels.triton_conv import causal_conv1d_triton

        return causal_conv1d_triton(x, weight, bias, conv_state, slots, query_start_loc, silu)
    lib = load_conv_kernels() if cpu_kernels.is_cpu_f32(x, weight, conv_state) else None
    if lib is None:
        return causal_conv1d_reference(x, weight, bias, conv_state, slots, query_start_loc, silu)
    if x.stride(1) != 1:
        x = x.contiguous()
    dim, k = weight.shape
    if query_start_loc is not None and query_start_loc.dtype != torch.int32:
        query_start_loc = query_start_loc.to(torch.int32)
    out = x.new_empty(x.shape[0], dim)
    cpu_kernels.launch(
        lib.causal_conv1d_f32,
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        conv_state.data_ptr(),
        slots.data_ptr(),
        query_start_loc.data_ptr() if query_start_loc is not None else None,
        slots.shape[0],
        dim,
        k,
        int(silu),
        out.data_ptr(),
    )
    return out
