"""Fill a model's parameters from (Hugging Face name, full tensor) pairs.

Checkpoint names that a model fuses (q/k/v into qkv_proj, gate/up into gate_up_proj) are
routed through ``packed_modules_mapping`` where the model has the fused parameter; every
other name must be a parameter of the model. Each parameter's ``weight_loader`` keeps the
slice its tensor-parallel rank holds. Once all are in, ``process_weights_after_loading``
hands each layer to its method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from minivllm.model.layers.linear import default_weight_loader


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: dict[str, tuple[str, object]],
    tied_head: str | None = None,
    rename: Callable[[str], str | None] = lambda name: name,
) -> set[str]:
    """Load the tensors into model; returns the parameter names filled.

    tied_head: the name of an LM head that shares the embedding (skipped if the checkpoint
    holds it, not required if it does not). rename maps a checkpoint name to the model's,
    or to None to skip the tensor.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None or name == tied_head:
            continue
        for part, (fused, shard_id) in packed_modules_mapping.items():
            target = name.replace(f".{part}.", f".{fused}.")
            # A layer may hold the projection unfused (Gemma 4's q_proj where K/V are shared).
            if f".{part}." in name and target in params:
                param = params[target]
                param.weight_loader(param, tensor, shard_id)
                break
        else:
            target = name
            if target not in params:
                raise ValueError(f"Unexpected weight {ckpt_name!r} in the checkpoint.")
            param = params[target]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded.add(target)
    missing = set(params) - loaded - {tied_head}
    if missing:
        raise ValueError(f"Weights missing from the checkpoint: {sorted(missing)[:5]}")
    return loaded


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's method rework its loaded weight once (pack it for oneDNN, ...)."""
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)
    # Then the layers made of such layers (a mixture of experts gathers its experts').
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
