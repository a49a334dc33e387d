"""Hugging Face model directories: config.json and the *.safetensors shards."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

# Image-and-text checkpoints served as their language model (vLLM serves their images too;
# this engine takes text only): their text config, under the checkpoint's architecture.
TEXT_OF_MULTIMODAL = (
    "Gemma3ForConditionalGeneration",
    "Gemma4ForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def load_hf_dir_config(folder: str) -> PretrainedConfig:
    """The directory's config.json, read by transformers (a multimodal checkpoint's text
    config, see TEXT_OF_MULTIMODAL)."""
    config = AutoConfig.from_pretrained(folder)
    architectures = getattr(config, "architectures", None) or []
    if architectures and architectures[0] in TEXT_OF_MULTIMODAL:
        text = config.get_text_config()
        text.architectures = list(architectures)
        if getattr(text, "dtype", None) is None:
            text.dtype = getattr(config, "dtype", None)
        return text
    return config


def load_generation_config(folder: str) -> dict[str, Any]:
    """The directory's generation_config.json as a dict; {} without one (or unreadable)."""
    try:
        with open(os.path.join(folder, "generation_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def safetensors_files(folder: str) -> list[str]:
    """The directory's weight files: those its index names, else every *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        # Trust the index over a glob: some repos also ship the same weights in other
        # *.safetensors files (e.g. consolidated.safetensors) under different names.
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        for file in files:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"shard listed in {index} is missing: {file}")
        return files
    files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory: {folder}")
    return files


def iter_safetensors_weights(
    folder: str, dtype: torch.dtype, device: torch.device | str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard under its checkpoint name, cast to dtype (floating ones:
    integer tensors, such as MXFP4 blocks, stay as stored); read straight onto ``device``
    (safetensors copies each from the file there: no host copy is kept)."""
    from safetensors import safe_open

    device = str(torch.device(device or "cpu"))
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt", device=device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensor = f.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
