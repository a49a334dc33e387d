"""Builds and loads the CPU's gated delta rule (gated_delta.c) as cpu_kernels.py builds its
library, and calls it. The switch is the layer kernels' (MINIVLLM_CPU_LAYER_KERNELS): set
to 0, the layer takes gated_delta_torch.py's chunked form instead."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from minivllm import envs
from minivllm.kernels import cpu_kernels

_SOURCE = os.path.join(os.path.dirname(__file__), "gated_delta.c")


def load_kernel() -> ctypes.CDLL | None:
    """The library, or None when the layer kernels are switched off or it cannot be built."""
    if not envs.MINIVLLM_CPU_LAYER_KERNELS:
        return None
    return _load()


@functools.cache
def _load() -> ctypes.CDLL | None:
    lib = cpu_kernels.compile_library(
        _SOURCE, list(cpu_kernels._FLAGS), "using torch for the gated delta rule"
    )
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.gated_delta_rule_f32
    fn.restype = None
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64] + [ptr] * 7 + [i64] * 5
    cpu_kernels.attach_slot_twins(lib, ["gated_delta_rule_f32"])
    return lib


def gated_delta_rule(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [T, Hk, Dk] float32, heads contiguous, rows may be strided
    k: torch.Tensor,  # [T, Hk, Dk], the same
    v: torch.Tensor,  # [T, Hv, Dv], the same
    a: torch.Tensor,  # [T, Hv] raw projections, the same
    b: torch.Tensor,  # [T, Hv], b's rows as a's
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    query_start_loc: torch.Tensor,  # [B + 1] int32 (the engine's)
    state_slots: torch.Tensor,  # [B] int64
    has_initial_state: torch.Tensor | None = None,  # [B] int64; None: all have one
    out: torch.Tensor | None = None,  # [T, Hv, Dv] contiguous
) -> torch.Tensor:
    """gated_delta_torch.gated_delta_rule with the gating fused: out [T, Hv, Dv]."""
    num_tokens, num_k_heads, head_k = q.shape
    _, num_v_heads, head_v = v.shape
    for x in (q, k, v):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError("the gated delta rule takes rows of contiguous heads")
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        raise ValueError("a and b must be rows of contiguous heads with one stride")
    if query_start_loc.dtype != torch.int32 or state_slots.dtype != torch.int64:
        raise ValueError("query_start_loc must be int32 and state_slots int64")
    if out is None:
        out = v.new_empty(num_tokens, num_v_heads, head_v)
    initial = has_initial_state.data_ptr() if has_initial_state is not None else None
    cpu_kernels.launch(
        lib.gated_delta_rule_f32,
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        a.data_ptr(),
        b.data_ptr(),
        a.stride(0),
        A_log.data_ptr(),
        dt_bias.data_ptr(),
        state.data_ptr(),
        query_start_loc.data_ptr(),
        state_slots.data_ptr(),
        initial,
        out.data_ptr(),
        state_slots.numel(),
        num_k_heads,
        num_v_heads,
        head_k,
        head_v,
    )
    return out
