from __future__ import annotations

import torch
from torch import nn

from minivllm import envs, kernels
from minivllm.kernels import cpu_kernels


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32, in the same order as the HF reference.

    ``norm(x, residual)`` is vLLM's fused form for pre-norm layers: the residual stream
    becomes ``x + residual`` and the norm is taken of it; it returns (normed, new residual).
    On float32 CPU tensors one C call does it (MINIVLLM_CPU_LAYER_KERNELS), on CUDA tensors
    one Triton kernel (MINIVLLM_GPU_LAYER_KERNELS).

    ``has_weight=False`` (vLLM's flag; Gemma 4's value and router norms): no learned scale,
    the weight a buffer of ones that no checkpoint fills.
    """

    def __init__(self, hidden_size: int, eps: float, has_weight: bool = True) -> None:
        super().__init__()
        if has_weight:
            self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        else:
            self.register_buffer("weight", torch.ones(hidden_size), persistent=False)
        self.eps = eps
        self.kernels = cpu_kernels.load_kernels("MINIVLLM_CPU_LAYER_KERNELS")
        self.gpu_kernels = envs.MINIVLLM_GPU_LAYER_KERNELS

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if (
            self.kernels is not None
            and cpu_kernels.is_cpu_f32(x, self.weight)
            and (x.is_contiguous() or residual is None)
            and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype))
        ):
            if residual is None:
                return cpu_kernels.rms_norm(self.kernels, _contiguous(x), self.weight, self.eps)
            residual = residual.clone() if residual is x else residual
            return cpu_kernels.rms_norm(self.kernels, x, self.weight, self.eps, residual), residual
        if (
            self.gpu_kernels
            and (gpu := kernels.triton_layers_for(x)) is not None
            and gpu.takes_rms_norm(x, self.weight, residual)
        ):
            if residual is None:
                return gpu.rms_norm(x, self.weight, self.eps)
            residual = residual.clone() if residual is x else residual
            return gpu.rms_norm(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMS norm: the weight is stored centred on zero and scales by (1 + weight),
    all in float32 before the cast back (HF's order).

    On float32 CPU tensors it is RMSNorm's C call with (1 + weight) as its weight: HF's
    product (x * rsqrt(...)) * (1 + weight), in the same float32 steps. Gemma 3 has six of
    them a layer (q/k norms and its sandwich norms), ~8 torch ops each otherwise."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self._scale: torch.Tensor | None = None  # 1 + weight, made at the first call

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As RMSNorm's: with residual (Qwen3-Next's pre-norm layers), the stream becomes
        x + residual and the norm is taken of it; returns (normed, new residual)."""
        if residual is not None:
            if (
                self.kernels is not None
                and cpu_kernels.is_cpu_f32(x, self.weight, residual)
                and x.is_contiguous()
                and residual.is_contiguous()
            ):
                residual = residual.clone() if residual is x else residual
                out = cpu_kernels.rms_norm(
                    self.kernels, x, self._offset_weight(), self.eps, residual
                )
                return out, residual
            residual = x + residual
            return self(residual), residual
        if self.kernels is not None and cpu_kernels.is_cpu_f32(x, self.weight):
            return cpu_kernels.rms_norm(
                self.kernels, _contiguous(x), self._offset_weight(), self.eps
            )
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def _offset_weight(self) -> torch.Tensor:
        if self._scale is None:  # after loading: the weight is final by the first call
            self._scale = 1.0 + self.weight
        return self._scale


class Gemma4RMSNorm(RMSNorm):
    """Gemma 4's RMS norm: a plain weight, as RMSNorm's, but multiplied in float32 before
    the cast back and the root taken with pow (HF's order, which matters in bfloat16; on
    float32 CPU tensors it is RMSNorm's C call)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and cpu_kernels.is_cpu_f32(x, self.weight):
            return cpu_kernels.rms_norm(self.kernels, _contiguous(x), self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (normed * self.weight.float()).type_as(x)


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    """x, or its copy in one buffer: q or k heads (Qwen3's, Gemma 3's) are a view of the
    fused qkv rows, contiguous only with one token. x.contiguous() would copy too, but with
    an op that allocates its output, which a CPU graph's capture refuses; copy_ into a
    buffer is replayed. (Every batch size then takes the kernel, as one token does.)"""
    return x if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype).copy_(x)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm with frozen parameters, as every other weight of the engine."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, elementwise_affine=affine)
        self.requires_grad_(False)
