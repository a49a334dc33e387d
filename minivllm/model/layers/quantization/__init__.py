"""Weight formats (dense, GGUF blocks): the LinearMethod a QuantizationConfig picks per layer."""

from __future__ import annotations

from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.layers.quantization.gguf import GGUFConfig

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {"gguf": GGUFConfig}


def get_quantization_config(quantization: str | None) -> QuantizationConfig | None:
    """The config for a resolved ``quantization`` name; None: dense weights."""
    if quantization is None:
        return None
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"Unknown quantization {quantization!r}; known: {sorted(QUANTIZATION_METHODS)}"
        )
    return QUANTIZATION_METHODS[quantization]()
