"""The engine's own kernels: C for the CPU (paged attention, small-batch linear, GGUF blocks,
the small layers; built on first use) and Triton for the GPU (paged attention, the small
layers)."""

from __future__ import annotations

from types import ModuleType

import torch


def triton_layers_for(x: torch.Tensor) -> ModuleType | None:
    """The Triton layer kernels (``triton_layers``) for a tensor on a CUDA device, imported at
    the first such call (a CPU install needs no Triton); None for any other tensor."""
    if not x.is_cuda:
        return None
    from minivllm.kernels import triton_layers

    return triton_layers
