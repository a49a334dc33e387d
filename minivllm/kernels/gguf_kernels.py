"""Builds and loads the GGUF kernels (gguf_kernels.c) on first use, as cpu_kernels.py does,
and wraps them for torch tensors.

A quantized weight is its GGUF bytes as loaded: a uint8 tensor [rows, bytes per row], with
its GGML type id. Three operations:
- ``dequantize``: rows (all, or the ones an embedding gathers) to float32, bit-exact
  against ``gguf.quants.dequantize``.
- ``pack`` once, then ``matmul_packed``: x @ W^T with x quantized to int8 per 32 values and
  integer dot products (AVX-512 VNNI where the CPU has it, AVX2, or plain C), on the
  weight repacked into 16-row tiles (``dequantize_packed`` reads rows back).
- ``moe_forward``: a mixture of experts' layer on packed experts, in one call.
- ``matmul_f32``: x @ W^T with W dequantized to float32 tile by tile and multiplied by
  torch: the exact reference for the quantized model (same weights as dequantizing at load).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from minivllm.kernels import cpu_kernels
from minivllm.kernels.cpu_kernels import compile_library
from minivllm.utils.huge_pages import huge_page_bytes

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "gguf_kernels.c")
# No -ffast-math and no fused multiply-adds the source did not ask for: the float32
# unpacking must round exactly as gguf's numpy code does.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]

# GGML type ids the kernels take (gguf.GGMLQuantizationType).
SUPPORTED_TYPES = {
    name: int(GGMLQuantizationType[name])
    for name in (
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
        "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
        "MXFP4",
    )
}  # fmt: skip
# type id -> (weights per block, bytes per block)
BLOCK_SIZES = {t: GGML_QUANT_SIZES[GGMLQuantizationType(t)] for t in SUPPORTED_TYPES.values()}

# Rows of weights dequantized at once by matmul_f32 (bounds its float32 scratch).
_F32_TILE_ELEMENTS = 1 << 22


def load_gguf_kernels(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel library, or None when it cannot be built (no C compiler). ``extra_flags``
    build a variant (tests: ``-mno-avx512f`` for the AVX2 path); each instruction set
    MINIVLLM_CPU_ISA forces is its own library."""
    return _load_gguf_kernels(extra_flags, cpu_kernels.cpu_isa())


@functools.cache
def _load_gguf_kernels(extra_flags: tuple[str, ...], isa: str) -> ctypes.CDLL | None:
    lib = compile_library(_SOURCE, [*_FLAGS, *extra_flags], "GGUF weights cannot stay quantized")
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gguf_type_supported.argtypes = [ctypes.c_int]
    lib.gguf_dequantize_rows.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, ptr]
    lib.gguf_packed_size.argtypes = [ctypes.c_int, i64, i64]
    lib.gguf_packed_size.restype = i64
    lib.gguf_pack.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    lib.gguf_packed_dequantize_rows.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, ptr]
    lib.gguf_packed_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, i64]
    lib.gguf_packed_matmul_refined.argtypes = lib.gguf_packed_matmul.argtypes
    lib.gguf_packed_path.restype = ctypes.c_char_p
    lib.gguf_moe_forward.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ctypes.c_int]
    lib.gguf_moe_forward.argtypes += [ctypes.c_int, ptr, ptr, ptr, ptr] * 2 + [ptr] * 3
    lib.gguf_moe_forward.argtypes += [ctypes.c_int, ctypes.c_float, ctypes.c_float, ptr]
    lib.gguf_set_grids.argtypes = [ptr] * 6
    twins = ["gguf_packed_matmul", "gguf_packed_matmul_refined", "gguf_moe_forward"]
    cpu_kernels.attach_slot_twins(lib, twins)
    lib.grids = _grids()  # kept with the library, which holds their addresses
    lib.gguf_set_grids(*(g.ctypes.data for g in lib.grids))
    return lib


def _grids() -> tuple[np.ndarray, ...]:
    """The IQ1-IQ3 codebooks as int8 [entries, 4 or 8], from gguf's own tables (IQ1: -1, 0,
    1; the others: magnitudes), in the order gguf_set_grids takes them."""
    out = []
    for cls in (quants.IQ2_XXS, quants.IQ2_XS, quants.IQ2_S, quants.IQ3_XXS, quants.IQ3_S,
                quants.IQ1_S):  # fmt: skip
        cls.init_grid()
        out.append(np.ascontiguousarray(cls.grid.reshape(cls.grid_shape).astype(np.int8)))
    return tuple(out)


def _lib() -> ctypes.CDLL:
    lib = load_gguf_kernels()
    if lib is None:
        raise RuntimeError("the GGUF kernels could not be built (is a C compiler installed?)")
    return lib


def anonymous_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` in an anonymous map of its own, for blocks that live only
    until they are repacked: the map goes back to the system when the tensor is freed, where
    malloc would keep most of these megabytes in its heap (hundreds of MB on a 3B model)."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]


def row_bytes(qtype: int, k: int) -> int:
    block, size = BLOCK_SIZES[qtype]
    if k % block:
        raise ValueError(f"row length {k} is not a multiple of the block size {block}")
    return k // block * size


def _check(raw: torch.Tensor, qtype: int, k: int) -> None:
    if qtype not in BLOCK_SIZES:
        raise ValueError(f"GGML type {qtype} is not supported by the GGUF kernels")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"expected uint8 [rows, {row_bytes(qtype, k)}], got {raw.shape}")
    if not raw.is_contiguous():
        raise ValueError("quantized weights must be contiguous")


def _checked(result: int) -> None:
    """The kernels return 0 for a type or shape they do not take (the checks here come
    first, so this is a guard against a caller that skipped them)."""
    if result == 0:
        raise ValueError("the GGUF kernel refused its arguments (type or shape)")


def dequantize(
    raw: torch.Tensor, qtype: int, k: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of ``raw`` (all, or those indexed by ``rows``) as float32 [len, k]."""
    _check(raw, qtype, k)
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= raw.shape[0]):
            raise IndexError("row index out of range")
    n = raw.shape[0] if rows is None else rows.numel()
    out = torch.empty(n, k, dtype=torch.float32)
    rows_ptr = rows.data_ptr() if rows is not None else None
    _checked(_lib().gguf_dequantize_rows(qtype, raw.data_ptr(), rows_ptr, n, k, out.data_ptr()))
    return out


def matmul_f32(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """x [m, k] @ W^T with W dequantized to float32 a tile of rows at a time."""
    _check(raw, qtype, k)
    n = raw.shape[0]
    tile = max(1, _F32_TILE_ELEMENTS // k)
    if tile >= n:
        return F.linear(x, dequantize(raw, qtype, k))
    parts = [F.linear(x, dequantize(raw[i : i + tile], qtype, k)) for i in range(0, n, tile)]
    return torch.cat(parts, dim=-1)


# ------------------------------------------------------------------ packed weights
# Every type repacked once for the integer kernel (see gguf_kernels.c): 16 rows interleaved
# per tile, float16 scales.


def packed_path(lib: ctypes.CDLL | None = None) -> str:
    """The integer path the library was built with: avx512-vnni, avx2 or portable."""
    return (lib or _lib()).gguf_packed_path().decode()


def packed_matmul_kernel(refined: bool = False) -> Callable[..., int]:
    """The C entry point itself, for callers that keep their arguments ready:
    (type, packed address, n, k, x address, m, y address, y row stride). ``refined``: the
    product whose activation rows get a second int8 pass over their block of largest
    max|x| (an outlier channel's; see gguf_packed_matmul_refined)."""
    lib = _lib()
    return lib.gguf_packed_matmul_refined if refined else lib.gguf_packed_matmul


def refines(qtype: int) -> bool:
    """Whether gguf_packed_matmul_refined takes this type (blocks of 32 values that stand
    alone in the packed layout)."""
    return qtype in _REFINED_TYPES


_REFINED_TYPES = {
    SUPPORTED_TYPES[name]
    for name in ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "IQ4_NL", "IQ4_XS")
} | {SUPPORTED_TYPES["MXFP4"]}


def pack(raw: torch.Tensor, qtype: int, k: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """GGUF blocks [n, row bytes] -> the packed layout, a flat uint8 tensor."""
    lib = lib or _lib()
    _check(raw, qtype, k)
    size = lib.gguf_packed_size(qtype, raw.shape[0], k)
    if size <= 0:
        raise ValueError(f"GGML type {qtype} has no packed layout")
    # The kernels stream packed weights front to back: in huge pages where the system has them.
    out = huge_page_bytes(size)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    _checked(lib.gguf_pack(qtype, raw.data_ptr(), raw.shape[0], k, out.data_ptr()))
    return out


def dequantize_packed(
    packed: torch.Tensor,
    qtype: int,
    n: int,
    k: int,
    rows: torch.Tensor | None = None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Rows of a packed [n, k] weight (all, or those indexed by ``rows``) as float32."""
    lib = lib or _lib()
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
        if rows.numel() and not _in_range(rows, n):
            raise IndexError("row index out of range")
    count = n if rows is None else rows.numel()
    out = torch.empty(count, k, dtype=torch.float32)
    rows_ptr = rows.data_ptr() if rows is not None else None
    _checked(
        lib.gguf_packed_dequantize_rows(
            qtype, packed.data_ptr(), rows_ptr, count, k, out.data_ptr()
        )
    )
    return out


def _in_range(rows: torch.Tensor, n: int) -> bool:
    """0 <= rows < n; a decode step's few ids as a list (two torch reductions took ~9 us
    of its embedding lookup)."""
    if rows.numel() <= 64:
        values = rows.tolist()
        return min(values) >= 0 and max(values) < n
    return int(rows.min()) >= 0 and int(rows.max()) < n


def matmul_packed(
    x: torch.Tensor,
    packed: torch.Tensor,
    qtype: int,
    n: int,
    k: int,
    lib: ctypes.CDLL | None = None,
    refined: bool = False,
) -> torch.Tensor:
    """x [m, k] float32 @ W^T, W packed [n, k], activations quantized to int8 per 32
    (``refined``: each row's block of largest max|x| twice, see packed_matmul_kernel)."""
    lib = lib or _lib()
    kernel = lib.gguf_packed_matmul_refined if refined else lib.gguf_packed_matmul
    x = x.to(torch.float32).contiguous()
    if x.shape[-1] != k or k % 32:
        raise ValueError(f"activations [.., {x.shape[-1]}] do not match k={k} (k % 32 == 0)")
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        _checked(kernel(qtype, packed.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr(), n))
    return y


# ------------------------------------------------------------------ mixtures of experts


@dataclass(frozen=True)
class PackedSegments:
    """One weight of every expert (gate_up, or down), all packed alike: segment s is
    ``rows[s]`` output rows of type ``types[s]`` from row ``offsets[s]``; expert e's bytes
    of it are at address ``addresses[e * len(types) + s]``."""

    types: torch.Tensor  # int64 [S]
    rows: torch.Tensor  # int64 [S]
    offsets: torch.Tensor  # int64 [S]
    addresses: torch.Tensor  # int64 [E * S]
    in_features: int
    keep: tuple[torch.Tensor, ...]  # the packed tensors the addresses point into

    def fits(self, out_features: int) -> bool:
        """Whether the segments are output rows [0, out_features) in order."""
        at = 0
        for rows, offset in zip(self.rows.tolist(), self.offsets.tolist(), strict=True):
            if offset != at or rows <= 0:
                return False
            at += rows
        return at == out_features

    def args(self) -> tuple[int, int, int, int, int]:
        t = self.types
        return (t.numel(), t.data_ptr(), self.rows.data_ptr(), self.offsets.data_ptr(),
                self.addresses.data_ptr())  # fmt: skip


# gguf_moe_forward's activations (besides silu(gate) * up)
_MOE_SWIGLU_OAI, _MOE_GELU_TANH = 1, 2


@dataclass(frozen=True)
class PackedExperts:
    """A layer's experts as ``moe_forward`` takes them: their gate_up weights (output rows
    [gate | up], 2 * inter) and their down weights (inter -> hidden); gpt-oss's: their
    biases ([experts, 2 * inter], [experts, hidden] float32) and its gating's alpha and
    limit (swiglu: (alpha, limit); None: silu(gate) * up); Gemma 4's: gelu (tanh's
    approximation) in place of silu, and a scale per expert ([experts] float32) on the
    chosen experts' weights."""

    gate_up: PackedSegments
    down: PackedSegments
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    swiglu: tuple[float, float] | None = None
    gelu: bool = False
    expert_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.down.addresses.numel() // self.down.types.numel()

    def __post_init__(self) -> None:
        inter, hidden = self.down.in_features, self.gate_up.in_features
        if self.gate_up.addresses.numel() // self.gate_up.types.numel() != self.num_experts:
            raise ValueError("gate_up and down weights of different numbers of experts")
        if max(self.gate_up.types.numel(), self.down.types.numel()) > 8:
            raise ValueError("the MoE kernel takes at most 8 segments a weight")
        if not self.gate_up.fits(2 * inter) or not self.down.fits(hidden):
            raise ValueError(
                f"expert weights of {self.gate_up.rows.tolist()} and {self.down.rows.tolist()} "
                f"rows do not fit hidden {hidden} and intermediate {inter}"
            )
        for bias, width in ((self.gate_up_bias, 2 * inter), (self.down_bias, hidden)):
            if bias is not None and (
                bias.shape != (self.num_experts, width)
                or bias.dtype != torch.float32
                or not bias.is_contiguous()
            ):
                raise ValueError(f"expert biases must be [{self.num_experts}, {width}] float32")
        scale = self.expert_scale
        if scale is not None and (
            scale.shape != (self.num_experts,) or scale.dtype != torch.float32
        ):
            raise ValueError(f"expert scales must be [{self.num_experts}] float32")
        if self.gelu and self.swiglu:
            raise ValueError("experts gate with gelu or with gpt-oss's swiglu, not both")


def moe_forward(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    experts: PackedExperts,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [m, hidden] float32, router_logits [m, experts] -> [m, hidden]: each token to the
    top_k experts by softmax(router_logits) (weights renormalised to sum to 1 where asked),
    out = sum_j weight_j * down(silu(gate(x)) * up(x)) of expert j (gpt-oss's: with its
    biases and gating; Gemma 4's: gelu, the weights scaled per expert), with activations
    quantized to int8 per 32 as ``matmul_packed`` does. One kernel call (noted by a CPU
    graph's capture)."""
    lib = lib or _lib()
    x = x.to(torch.float32).contiguous()
    router_logits = router_logits.to(torch.float32).contiguous()
    m, hidden = x.shape
    gate_up, down, n = experts.gate_up, experts.down, experts.num_experts
    if hidden != gate_up.in_features or router_logits.shape != (m, n) or not 1 <= top_k <= n:
        raise ValueError(
            f"x {tuple(x.shape)}, router logits {tuple(router_logits.shape)} and top {top_k} "
            f"do not fit {n} experts of {gate_up.in_features} input features"
        )
    out = x.new_empty(m, hidden)
    biases = [
        b.data_ptr() if b is not None else None for b in (experts.gate_up_bias, experts.down_bias)
    ]
    alpha, limit = experts.swiglu or (0.0, 0.0)
    activation = _MOE_SWIGLU_OAI if experts.swiglu else _MOE_GELU_TANH if experts.gelu else 0
    scale = experts.expert_scale
    if m:
        cpu_kernels.launch(
            lib.gguf_moe_forward, x.data_ptr(), m, hidden, down.in_features,
            router_logits.data_ptr(), n, top_k, int(renormalize), *gate_up.args(),
            *down.args(), out.data_ptr(), *biases, activation, alpha, limit,
            scale.data_ptr() if scale is not None else None, checked=True,
        )  # fmt: skip
    return out
