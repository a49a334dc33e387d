"""The device the engine runs on: one Platform (CPU, CUDA) owns everything device-specific."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from minivllm.config import DEVICES

if TYPE_CHECKING:
    from minivllm.platforms.interface import Platform

__all__ = ["DEVICES", "get_platform", "resolve_device"]


def resolve_device(device: str) -> str:
    """ "cpu" or "cuda" for the user's ``device``; "auto" is CUDA when torch sees a GPU."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}.")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def get_platform(device: str = "auto") -> Platform:
    """The platform for ``device`` ("auto", "cpu" or "cuda"); one instance per kind."""
    return _platform(resolve_device(device))


@functools.cache
def _platform(kind: str) -> Platform:
    if kind == "cuda":
        from minivllm.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from minivllm.platforms.cpu import CpuPlatform

    return CpuPlatform()
