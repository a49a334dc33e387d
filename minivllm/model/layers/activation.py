"""Gated activations: each takes the fused gate/up projection's output [..., 2d] -> [..., d]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm import envs, kernels
from minivllm.kernels import cpu_kernels


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up] ([..., 2d] -> [..., d]), as vLLM's; one C call
    on float32 CPU tensors (MINIVLLM_CPU_LAYER_KERNELS), one Triton kernel on CUDA tensors
    (MINIVLLM_GPU_LAYER_KERNELS)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = cpu_kernels.load_kernels("MINIVLLM_CPU_LAYER_KERNELS")
        self.gpu_kernels = envs.MINIVLLM_GPU_LAYER_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and cpu_kernels.is_cpu_f32(x) and x.is_contiguous():
            return cpu_kernels.silu_and_mul(self.kernels, x)
        if (
            self.gpu_kernels
            and (gpu := kernels.triton_layers_for(x)) is not None
            and x.stride(-1) == 1
            and (x.dim() == 2 or x.is_contiguous())
        ):
            return gpu.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class SwigluOAIAndMul(nn.Module):
    """gpt-oss's gated activation, vLLM's name: for x = [gate | up], the gate clamped from
    above and up on both sides at ``limit``, then (up + 1) * gate * sigmoid(alpha * gate)."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.alpha = alpha
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GeluAndMul(nn.Module):
    """gelu(gate) * up for x = [gate | up], vLLM's name; approximate="tanh" is HF's
    ``gelu_pytorch_tanh`` (Gemma's). Written into a buffer (out=): a decode step replayed
    as a CPU graph (worker/cpu_graph.py) keeps ops that write a given output."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        out = torch.empty_like(up)
        torch.ops.aten.gelu.out(gate, approximate=self.approximate, out=out)
        return torch.mul(out, up, out=out)
