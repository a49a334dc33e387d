"""Builds and loads the CPU's Gated DeltaNet kernels (gated_delta.c) as cpu_kernels.py builds
its library, and calls them: the gated delta rule, the output norm gated by SiLU(z), and
the gated attention's sigmoid output gate. Each call goes through ``cpu_kernels.launch``,
so a decode step of these models replays as a CPU graph (worker/cpu_graph.py). The switch
is the layer kernels' (MINIVLLM_CPU_LAYER_KERNELS): set to 0, the layers take torch
(gated_delta_torch.py's chunked form) instead."""

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
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64] + [ptr] * 7 + [i64] * 6
    fn.argtypes += [ptr, i64, ptr, ctypes.c_float]  # the output norm's gate, weight, eps
    lib.gated_rms_norm_f32.restype = None
    lib.gated_rms_norm_f32.argtypes = [ptr, ptr, i64, ptr, ctypes.c_float, ptr, i64, i64, i64]
    lib.sigmoid_gate_f32.restype = None
    lib.sigmoid_gate_f32.argtypes = [ptr, ptr] + [i64] * 5
    names = ["gated_delta_rule_f32", "gated_rms_norm_f32", "sigmoid_gate_f32"]
    cpu_kernels.attach_slot_twins(lib, names)
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
    query_start_loc: torch.Tensor | None,  # [B + 1] int32 (the engine's); None: a decode
    state_slots: torch.Tensor,  # [B] int64                       step, sequence i is row i
    has_initial_state: torch.Tensor | None = None,  # [B] int64; None: all have one
    out: torch.Tensor | None = None,  # [T, Hv, Dv] contiguous
    tiled: bool = False,  # value head h reads key head h % Hk (else h // (Hv / Hk))
    norm_gate: torch.Tensor | None = None,  # [T, Hv, Dv], heads contiguous, rows strided
    norm_weight: torch.Tensor | None = None,  # [Dv]
    eps: float = 1e-6,
) -> torch.Tensor:
    """gated_delta_torch.gated_delta_rule with the gating fused: out [T, Hv, Dv]. Given
    norm_gate and norm_weight, each head's output is then gated_rms_norm's in the same
    call (gated_rms_norm's result, bit for bit: one function in C does both)."""
    num_tokens, num_k_heads, head_k = q.shape
    _, num_v_heads, head_v = v.shape
    for x in (q, k, v):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError("the gated delta rule takes rows of contiguous heads")
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        raise ValueError("a and b must be rows of contiguous heads with one stride")
    if query_start_loc is not None and query_start_loc.dtype != torch.int32:
        raise ValueError("query_start_loc must be int32")
    if state_slots.dtype != torch.int64:
        raise ValueError("state_slots must be int64")
    if out is None:
        out = v.new_empty(num_tokens, num_v_heads, head_v)
    if (norm_gate is None) != (norm_weight is None):
        raise ValueError("the output norm takes both its gate and its weight")
    if norm_gate is not None and (
        norm_gate.shape != out.shape or norm_gate.stride()[1:] != (head_v, 1)
    ):
        raise ValueError("the output norm's gate must be rows of contiguous heads as out")
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
        query_start_loc.data_ptr() if query_start_loc is not None else None,
        state_slots.data_ptr(),
        initial,
        out.data_ptr(),
        state_slots.numel(),
        num_k_heads,
        num_v_heads,
        head_k,
        head_v,
        int(tiled),
        norm_gate.data_ptr() if norm_gate is not None else None,
        norm_gate.stride(0) if norm_gate is not None else 0,
        norm_weight.data_ptr() if norm_weight is not None else None,
        eps,
    )
    return out


def _heads_contiguous(x: torch.Tensor) -> bool:
    """Rows of heads, each head's values contiguous (rows and heads may be strided)."""
    return x.dim() == 3 and x.stride(2) == 1


def gated_rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [T, H, D] float32, contiguous
    gate: torch.Tensor,  # [T, H, D], heads contiguous, rows may be strided
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    """weight * x / rms(x) * silu(gate) per head, in place in x (which it returns)."""
    rows, heads, dim = x.shape
    if not x.is_contiguous() or gate.shape != x.shape or gate.stride()[1:] != (dim, 1):
        raise ValueError("gated_rms_norm takes contiguous x and a gate of heads in rows")
    cpu_kernels.launch(
        lib.gated_rms_norm_f32, x.data_ptr(), gate.data_ptr(), gate.stride(0),
        weight.data_ptr(), eps, x.data_ptr(), rows, heads, dim,
    )  # fmt: skip
    return x


def sigmoid_gate(lib: ctypes.CDLL, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] contiguous times sigmoid(gate) (heads contiguous, rows and heads may be
    strided), in place; returns x."""
    rows, heads, dim = x.shape
    if not x.is_contiguous() or gate.shape != x.shape or not _heads_contiguous(gate):
        raise ValueError("sigmoid_gate takes contiguous x and a gate of contiguous heads")
    cpu_kernels.launch(
        lib.sigmoid_gate_f32, x.data_ptr(), gate.data_ptr(), gate.stride(0), gate.stride(1),
        rows, heads, dim,
    )  # fmt: skip
    return x
