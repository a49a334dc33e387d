"""Applying a step's grammar bitmask to the logits: forbidden tokens get -inf.

On the CPU a C kernel (bitmask_kernel.c, built on first use like the other kernels) does
it: it writes -inf only where a 32-token word of the mask is not all ones and never reads
the logits, where xgrammar's CPU kernel visits every logit. For a batch of 256 rows of
49,152 tokens that is a few milliseconds against tens (the logits are 50 MB). Without a C
compiler, or for logits elsewhere than in CPU float32 rows, xgrammar's kernel does it.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

_SOURCE = os.path.join(os.path.dirname(__file__), "bitmask_kernel.c")
# No -ffast-math: the kernel has no floating point to speed up.
_FLAGS = ["-O3", "-march=native"]


@functools.cache
def _kernel():
    from minivllm.kernels.cpu_kernels import compile_library

    lib = compile_library(_SOURCE, _FLAGS, "using xgrammar's kernel for grammar bitmasks")
    if lib is None:
        return None
    fn = lib.apply_token_bitmask_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    return fn


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] (in place): row rows[i] keeps only the tokens bitmask[i] allows.

    rows: [n] long; bitmask: [n, ceil(V' / 32)] int32 (bit t of word w allows token
    32 * w + t). Tokens past min(V, 32 * bitmask.shape[1]) are left alone, as xgrammar's
    kernel leaves them."""
    vocab_size = min(logits.shape[1], bitmask.shape[1] * 32)
    kernel = _kernel() if _kernel_fits(logits) else None
    if kernel is None:
        _apply_with_xgrammar(logits, rows, bitmask, vocab_size)
        return
    rows = rows.to(torch.int64).contiguous()
    bitmask = bitmask.to(torch.int32).contiguous()
    assert rows.numel() == bitmask.shape[0]
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        raise IndexError("grammar bitmask rows out of range of the logits")
    kernel(
        logits.data_ptr(),
        logits.stride(0),
        bitmask.data_ptr(),
        bitmask.shape[1],
        rows.data_ptr(),
        rows.numel(),
        vocab_size,
    )


def _kernel_fits(logits: torch.Tensor) -> bool:
    from minivllm.kernels.cpu_kernels import is_cpu_f32

    return is_cpu_f32(logits) and logits.dim() == 2 and logits.stride(1) == 1


def _apply_with_xgrammar(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, vocab_size: int
) -> None:
    import xgrammar as xgr

    # xgrammar wants one bitmask row per logits row, read through the rows to mask.
    full = torch.full(
        (logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device
    )
    full[rows.to(bitmask.device)] = bitmask
    xgr.apply_token_bitmask_inplace(
        logits, full.to(logits.device), vocab_size=vocab_size, indices=rows.tolist()
    )
