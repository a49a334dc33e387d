"""The engine's own kernels: C for the CPU, Triton for the GPU (each module says which)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch


def triton_layers_for(x: torch.Tensor) -> ModuleType | None:
    """The Triton layer kernels (``triton_layers``) for a tensor whose platform takes them
    (CUDA's), imported at the first such call: a CPU install needs no Triton. None for any
    other tensor."""
    if not _takes_triton_layers(x.device.type):  # asked per layer call: cached per device
        return None
    from minivllm.kernels import triton_layers

    return triton_layers


def triton_linear_for(x: torch.Tensor) -> ModuleType | None:
    """The Triton small-M product (``triton_linear``) for a tensor whose platform runs
    the Triton layer kernels, as ``triton_layers_for``."""
    if not _takes_triton_layers(x.device.type):
        return None
    from minivllm.kernels import triton_linear

    return triton_linear


@functools.cache
def _takes_triton_layers(device_type: str) -> bool:
    from minivllm.platforms import get_platform

    return get_platform(device_type).runs_triton_layer_kernels()
