"""Gated activations: ``SiluAndMul`` takes the fused gate/up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels import cpu_kernels


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up] ([..., 2d] -> [..., d]), as vLLM's; one C call
    on float32 CPU tensors (MINIVLLM_CPU_LAYER_KERNELS)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = cpu_kernels.load_kernels("MINIVLLM_CPU_LAYER_KERNELS")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and cpu_kernels.is_cpu_f32(x) and x.is_contiguous():
            return cpu_kernels.silu_and_mul(self.kernels, x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
