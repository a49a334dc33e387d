"""What Ollama's /api/show says of a model: its `details` (family, parameter size,
quantization level) and its `model_info` under llama.cpp's metadata keys. Clients read the
context window there (`<general.architecture>.context_length`: VS Code's and Continue's
Ollama providers), so it is the length this server serves, not the model's trained one."""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np

# The compute dtype's name as Ollama's quantization_level writes an unquantized model's.
_DTYPE_LEVELS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def describe(config) -> tuple[dict[str, Any], dict[str, Any]]:
    """(details, model_info) of a model with this ModelConfig."""
    path = config.model
    stamp = os.stat(path).st_mtime_ns if os.path.exists(path) else 0
    metadata, parameters, level = _read_weights(path, stamp)
    metadata = dict(metadata)  # the cached one stays as read
    hf = config.hf_config
    arch = str(metadata.get("general.architecture") or getattr(hf, "model_type", "") or "")
    if not metadata:  # a folder: its config's sizes under llama.cpp's keys
        sizes = {
            "embedding_length": "hidden_size",
            "block_count": "num_hidden_layers",
            "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads",
            "vocab_size": "vocab_size",
        }
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        for key, name in sizes.items():
            value = getattr(text, name, None)
            if isinstance(value, int):
                metadata[f"{arch}.{key}"] = value
        metadata["general.architecture"] = arch
    if config.quantization and config.quantization != "gguf":  # quantized at load
        level = config.quantization.upper()
    level = level or _DTYPE_LEVELS.get(config.dtype, "")
    info = {**metadata, "general.parameter_count": parameters}
    info[f"{arch}.context_length"] = config.max_model_len
    details = {
        "parent_model": "",
        "format": "gguf" if config.model.endswith(".gguf") else "safetensors",
        "family": arch,
        "families": [arch],
        "parameter_size": _human(parameters),
        "quantization_level": level,
    }
    return details, info


@functools.lru_cache(maxsize=32)
def _read_weights(path: str, stamp: int) -> tuple[dict[str, Any], int, str]:
    """(the GGUF metadata's scalars, the parameter count, the GGUF file type's name) of the
    weights at path, read from headers only (a folder: {}, its safetensors' count, "");
    stamp: the path's mtime, so that a file replaced under its name is read again."""
    if path.endswith(".gguf"):
        import gguf

        from minivllm.model.loader.gguf_header import read_gguf_header

        header = read_gguf_header(path)
        metadata = {}
        for key, value in header.metadata.items():
            value = value.item() if isinstance(value, np.generic) else value
            if key.startswith(("tokenizer.", "split.")) or isinstance(value, np.ndarray):
                continue  # (arrays left out, as in Ollama's answer when not verbose)
            if not isinstance(value, float) or math.isfinite(value):  # JSON has no NaN
                metadata[key] = value
        parameters = sum(math.prod(shape) for shape in header.tensor_shapes.values())
        file_type = metadata.get("general.file_type")
        try:
            level = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            level = ""
        return metadata, parameters, level.removeprefix("ALL_")
    return {}, _safetensors_parameters(path), ""


def _safetensors_parameters(folder: str) -> int:
    """The element count of every tensor in a folder's safetensors files (their headers)."""
    from safetensors import safe_open

    if not os.path.isdir(folder):
        return 0
    total = 0
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="numpy") as f:
                keys = f.keys()
                total += sum(math.prod(f.get_slice(key).get_shape()) for key in keys)
    return total


def _human(count: int) -> str:
    """A parameter count as Ollama writes one ("135M", "7.6B"); "" when unknown."""
    if count >= 1e9:
        return f"{count / 1e9:.1f}B"
    if count >= 1e6:
        return f"{count / 1e6:.0f}M"
    return f"{count / 1e3:.0f}K" if count else ""
