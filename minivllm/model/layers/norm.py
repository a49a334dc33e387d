from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32, in the same order as the HF reference."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMS norm: the weight is stored centred on zero and scales by (1 + weight),
    all in float32 before the cast back (HF's order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm with frozen parameters, as every other weight of the engine."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, elementwise_affine=affine)
        self.requires_grad_(False)
