"""Weight formats (dense, a GGUF file's blocks, blocks made at load): a layer's LinearMethod."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.layers.quantization.gguf import GGUFConfig
from minivllm.model.layers.quantization.online import ONLINE_TYPES, OnlineQuantConfig

QUANTIZATION_METHODS: dict[str, Callable[[], QuantizationConfig]] = {"gguf": GGUFConfig}
QUANTIZATION_METHODS |= {name: partial(OnlineQuantConfig, name) for name in ONLINE_TYPES}


def get_quantization_config(quantization: str | None) -> QuantizationConfig | None:
    """The config for a resolved ``quantization`` name; None: dense weights."""
    if quantization is None:
        return None
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"Unknown quantization {quantization!r}; known: {sorted(QUANTIZATION_METHODS)}"
        )
    return QUANTIZATION_METHODS[quantization]()
