"""A Triton product for a few rows (a decode step's 1-16 tokens) by a bf16/fp16 weight:
``x @ weight.T`` read at the card's bandwidth.

Why: on an H200 (BENCHMARKS.md, issue 55) one stream's decode step of the Qwen3-0.6B shape
is 1.43 ms of kernels, 0.80 ms of them cuBLAS's one-row products, which read their weights
at 1.1-2.3 TB/s of the card's 4.2: gate_up's 12.6 MB took 11.4 us. A row of tokens reuses
nothing, so the product is a read of the weight; what matters is enough programs in flight
to keep every memory channel busy. Each program here reads a [BLOCK_N, K] slab of the
weight (BLOCK_N outputs), so a wide product (qkv, gate_up) has hundreds of programs; a
narrow one (o, down: 1,024 outputs) splits K too, into fp32 partial sums that a second
small kernel adds up and rounds (cuBLAS's split-K does the same).

Opt-in (``MINIVLLM_TRITON_SMALL_M_LINEAR``) until a GPU session measures it against
cuBLAS (``benchmarks/gpu_session.sh ab MINIVLLM_TRITON_SMALL_M_LINEAR``). Under
``TRITON_INTERPRET=1`` it runs on CPU tensors (the tests' way in CI).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # tl.dot's smallest tile; a decode graph of up to 16 rows
BLOCK_N = 16
BLOCK_K = 256
TARGET_PROGRAMS = 264  # two per multiprocessor of an H100/H200 (132)


@triton.jit
def _small_m_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N] in x's dtype, or [SPLIT_K, M, N] float32 partial sums
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )
        # In fp32: a half-precision value is exact in TF32, so the product is too; and the
        # interpreter's dot takes no bf16. The card's matrix rate is not what binds here.
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        base = out_ptr + pid_k.to(tl.int64) * M * N
        tl.store(base + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(partial_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A few rows by a half-precision weight (float32 would take tl.dot's TF32)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.stride(1) == 1
    )


def split_k(n: int, k: int) -> int:
    """How many parts K is split into: enough programs for the whole card, each still
    reading at least two BLOCK_K steps."""
    programs = triton.cdiv(n, BLOCK_N)
    splits = 1
    while programs * splits < TARGET_PROGRAMS and k // (splits * 2) >= 2 * BLOCK_K:
        splits *= 2
    return splits


def small_m_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``supports(x, weight)``; fp32 accumulation, one
    rounding to the weight's dtype (and one more with a bias, as torch's addmm)."""
    m, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(m, n)
    splits = split_k(n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    grid = (triton.cdiv(n, BLOCK_N), splits)
    target = out if splits == 1 else x.new_empty(splits, m, n, dtype=torch.float32)
    _small_m_linear_kernel[grid](
        x, weight, target, m, n, k, x.stride(0), weight.stride(0), k_per_split,
        BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT=splits > 1,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            target, out, m * n, SPLIT_K=splits, BLOCK=block
        )
    return out if bias is None else out.add_(bias)
