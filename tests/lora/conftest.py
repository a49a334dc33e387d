"""Tiny LoRA adapters for the tiny checkpoints, in PEFT's format, and their references: the
base checkpoint with each adapter merged into its weights (W + scaling * B @ A)."""

from __future__ import annotations

import json
import os
import shutil

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(
    base: str | dict,
    folder: str,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    targets=TARGETS,
    use_rslora: bool = False,
    std: float = 0.3,
    **config_keys,
) -> str:
    """A random LoRA of the base checkpoint's linear layers (base: its folder, or its state
    dict), saved as PEFT saves one."""
    from safetensors.torch import load_file, save_file

    weights = base if isinstance(base, dict) else load_file(os.path.join(base, "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in weights.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in targets:
            continue
        out_features, in_features = weight.shape
        a = torch.randn(rank, in_features, generator=generator) * std
        b = torch.randn(out_features, rank, generator=generator) * std
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "use_rslora": use_rslora,
        "bias": "none",
        "modules_to_save": None,
        **config_keys,
    }
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def merged_weights(weights: dict, adapter: str) -> dict:
    """The weights with the adapter merged in: W + scaling * B @ A."""
    from safetensors.torch import load_file

    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    rank = config["r"]
    scaling = config["lora_alpha"] / (rank**0.5 if config.get("use_rslora") else rank)
    lora = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    weights = dict(weights)
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = f"{module}.weight"
        weights[name] = weights[name] + scaling * (b.double() @ a.double()).to(weights[name].dtype)
    return weights


def merge_adapter(base: str, adapter: str, folder: str) -> str:
    """The base checkpoint with the adapter merged into its weights: what serving the adapter
    must compute."""
    from safetensors.torch import load_file, save_file

    weights = merged_weights(load_file(os.path.join(base, "model.safetensors")), adapter)
    shutil.copytree(base, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(weights, os.path.join(folder, "model.safetensors"))
    return folder
