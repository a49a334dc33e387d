"""The fixed rotation a quantized KV cache stores its keys in.

Some models' keys have outlier channels (Qwen2's k bias makes a few of a head's 64 channels
~10-50x the others): with one int8 scale per (token, KV head) the other channels keep only
a few levels. An orthogonal R leaves every score unchanged, (q R) . (k R) = q . k, and a
normalized Hadamard matrix (with fixed random signs on its rows, so that no structured key
lines up with one of its rows) spreads an outlier over every channel, so one scale per row
keeps them all (QuaRot's and SpinQuant's trick). The keys are written rotated and each
query is rotated once per step; the kernels are unchanged.
"""

from __future__ import annotations

import functools

import torch

_SEED = 53


@functools.cache
def rotation_matrix(head_dim: int) -> torch.Tensor:
    """[head_dim, head_dim] float32 orthogonal: diag(signs) @ H / sqrt(head_dim) for a power
    of two (Sylvester's Hadamard), else a fixed random orthogonal matrix (QR of a seeded
    Gaussian). The same for every process (fixed seed), so a cache on disk stays readable."""
    gen = torch.Generator().manual_seed(_SEED)
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
        return (signs[:, None] * h / head_dim**0.5).contiguous()
    g = torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64)
    qm, r = torch.linalg.qr(g)
    return (qm * torch.sign(torch.diagonal(r))).float().contiguous()


@functools.cache
def rotation_on(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """rotation_matrix on a device in a dtype, made once (a per-step copy to a GPU would cost
    a transfer per layer and break CUDA graph capture)."""
    return rotation_matrix(head_dim).to(device, dtype)
