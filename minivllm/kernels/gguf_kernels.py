"""Builds and loads the GGUF kernels (gguf_kernels.c) on first use, as cpu_kernels.py does,
and wraps them for torch tensors.

A quantized weight is its GGUF bytes as loaded: a uint8 tensor [rows, bytes per row], with
its GGML type id. Three operations:
- ``dequantize``: rows (all, or the ones an embedding gathers) to float32, bit-exact
  against ``gguf.quants.dequantize``.
- ``matmul_q8``: x @ W^T with x quantized to int8 per 32 values and integer dot products
  (AVX-512 VNNI where the CPU has it, plain C otherwise).
- ``matmul_f32``: x @ W^T with W dequantized to float32 tile by tile and multiplied by
  torch: the exact reference for the quantized model (same weights as dequantizing at load).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch
import torch.nn.functional as F

from minivllm.kernels.cpu_kernels import _cache_dir, _cpu_flags

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "gguf_kernels.c")
# No -ffast-math and no fused multiply-adds the source did not ask for: the float32
# unpacking must round exactly as gguf's numpy code does.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]

# GGML type ids the kernels take (gguf.GGMLQuantizationType).
SUPPORTED_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8}
SUPPORTED_TYPES.update({"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14})
# type id -> (weights per block, bytes per block)
BLOCK_SIZES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34)}
BLOCK_SIZES.update({10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176)})
BLOCK_SIZES[14] = (256, 210)

# Rows of weights dequantized at once by matmul_f32 (bounds its float32 scratch).
_F32_TILE_ELEMENTS = 1 << 22


@functools.cache
def load_gguf_kernels() -> ctypes.CDLL | None:
    """The kernel library, or None when it cannot be built (no C compiler)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    with open(_SOURCE, "rb") as f:
        source = f.read()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_flags()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"gguf_kernels-{digest}.so")
    if not os.path.exists(path):
        if compiler is None:
            logger.warning("No C compiler found: GGUF weights cannot stay quantized.")
            return None
        os.makedirs(_cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *_FLAGS, _SOURCE, "-o", tmp, "-lm"], check=True, capture_output=True
            )
            os.replace(tmp, path)  # atomic: a concurrent start sees all or nothing
        except (OSError, subprocess.CalledProcessError) as err:
            os.unlink(tmp)
            logger.warning("Could not build the GGUF kernels (%s).", err)
            return None
    lib = ctypes.CDLL(path)
    lib.gguf_type_supported.argtypes = [ctypes.c_int]
    lib.gguf_dequantize_rows.argtypes = (
        [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    )
    lib.gguf_matmul_q8.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.gguf_matmul_q8.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return lib


def _lib() -> ctypes.CDLL:
    lib = load_gguf_kernels()
    if lib is None:
        raise RuntimeError("the GGUF kernels could not be built (is a C compiler installed?)")
    return lib


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
    _lib().gguf_dequantize_rows(qtype, raw.data_ptr(), rows_ptr, n, k, out.data_ptr())
    return out


def matmul_q8(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """x [m, k] float32 @ W^T, W the quantized [n, k], activations quantized to int8."""
    _check(raw, qtype, k)
    x = x.to(torch.float32).contiguous()
    if x.shape[-1] != k or k % 32:
        raise ValueError(f"activations [.., {x.shape[-1]}] do not match k={k} (k % 32 == 0)")
    m, n = x.shape[0], raw.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        _lib().gguf_matmul_q8(qtype, raw.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr())
    return y


def matmul_f32(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """x [m, k] @ W^T with W dequantized to float32 a tile of rows at a time."""
    _check(raw, qtype, k)
    n = raw.shape[0]
    tile = max(1, _F32_TILE_ELEMENTS // k)
    if tile >= n:
        return F.linear(x, dequantize(raw, qtype, k))
    parts = [F.linear(x, dequantize(raw[i : i + tile], qtype, k)) for i in range(0, n, tile)]
    return torch.cat(parts, dim=-1)
