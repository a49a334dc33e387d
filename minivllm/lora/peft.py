"""Reading a PEFT LoRA adapter: its config, checked against the engine's limits before any
request uses it, and its A and B matrices by the base model's module names.

A LoRA adds ``scaling * B @ A`` to a linear layer's weight W (A: rank x in, B: out x rank;
scaling = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA), so the layer computes
``x W^T + scaling * (x A^T) B^T``. Only the decoder's linear layers are adapted: adapters
that train the embeddings or the LM head (extra vocabulary, modules_to_save), DoRA, or
biases are refused, as they change more than a low-rank product.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float
    weights_file: str


def read_adapter_config(path: str, max_lora_rank: int) -> AdapterConfig:
    """The adapter's rank and scaling, or a ValueError saying why it cannot be served."""
    path = os.path.expanduser(path)
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"No adapter found at {path!r} (no {CONFIG_FILE}).") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Cannot read the adapter's {config_path!r}: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"The adapter at {path!r} is not a LoRA (peft_type LORA).")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"The adapter at {path!r} has no valid rank r: {rank!r}.")
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank} (--max-lora-rank)."
        )
    if config.get("modules_to_save"):
        raise ValueError(
            f"The adapter at {path!r} trains whole modules ({config['modules_to_save']}): "
            "only LoRA on the decoder's linear layers is supported."
        )
    if config.get("bias", "none") != "none":
        raise ValueError(f"The adapter at {path!r} trains biases: not supported.")
    if config.get("use_dora"):
        raise ValueError(f"The adapter at {path!r} is a DoRA: not supported.")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"The adapter at {path!r} has no valid lora_alpha: {alpha!r}.")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return AdapterConfig(rank, float(scaling), os.path.join(path, name))
    raise ValueError(f"The adapter at {path!r} has no weights ({' or '.join(WEIGHT_FILES)}).")


def read_adapter_weights(config: AdapterConfig) -> dict[str, tuple]:
    """module name (as the base model's checkpoint names it, e.g.
    "model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r]), float32 on the host."""
    import torch

    try:
        if config.weights_file.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors = load_file(config.weights_file)
        else:  # weights_only: a pickle names code to run; tensors alone are read
            tensors = torch.load(config.weights_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt file is the request's fault, not the engine's
        raise ValueError(f"Cannot read the adapter's {config.weights_file!r}: {exc}") from None
    if not isinstance(tensors, dict):
        raise ValueError(f"The adapter's {config.weights_file!r} holds no named tensors.")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name:
                module = name.split(marker)[0]
                pairs.setdefault(module, {})[part] = tensor.float()
                break
        else:
            raise ValueError(
                f"The adapter's tensor {key!r} is not a LoRA A or B matrix (embeddings, "
                "the LM head or DoRA magnitudes are not supported)."
            )
    weights = {}
    for module, parts in pairs.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise ValueError(f"The adapter's module {module!r} lacks its A or B matrix.")
        a, b = parts["lora_A"], parts["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.rank or b.shape[1] != config.rank:
            raise ValueError(
                f"The adapter's module {module!r} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, not of its rank {config.rank}."
            )
        weights[module] = (a, b)
    return weights
