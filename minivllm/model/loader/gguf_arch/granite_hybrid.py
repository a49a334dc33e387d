"""Granite 4.0-H (granitehybrid): Mamba-2 layers and Granite's attention layers, with a
dense MLP or experts beside a shared MLP.

llama.cpp writes the layers' kinds as the per-layer KV head count (0 for a Mamba layer),
permutes the attention's q/k rows as for Llama, splits the fused gate|up matrices, stores
Mamba's A as -exp(A_log) and A and D as [heads, 1], its gated norm as [groups, width],
the convolution's taps squeezed to [channels, taps]; whether the attention uses RoPE is
``rope.scaling.finetuned`` (Granite 4.0-H's layers use none).
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm.model.loader.gguf_arch.base import (
    LAYER_NAMES,
    GGUFArch,
    GGUFMeta,
    kv_heads_per_layer,
)
from minivllm.model.loader.gguf_arch.llama import _granite

GRANITE_HYBRID_LAYER_NAMES = {
    **LAYER_NAMES,
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_dt.bias": "mamba.dt_bias",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
    # With experts the dense MLP is the shared one (the model's own names for both).
    "ffn_gate_shexp": "mlp.shared.gate_proj",
    "ffn_up_shexp": "mlp.shared.up_proj",
    "ffn_down_shexp": "mlp.shared.down_proj",
    "ffn_gate_inp": "mlp.moe.gate",
    "ffn_gate_exps": "mlp.moe.experts.gate_proj",
    "ffn_up_exps": "mlp.moe.experts.up_proj",
    "ffn_down_exps": "mlp.moe.experts.down_proj",
}


def _granite_hybrid(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    kv_heads = kv_heads_per_layer(meta)
    first_mamba = kv_heads.index(0) if 0 in kv_heads else 0
    shapes = meta.shapes
    experts = int(meta.get("expert_count", 0))
    shared = "ffn_gate_shexp" if experts else "ffn_gate"
    heads, inner = int(meta.get("ssm.time_step_rank")), int(meta.get("ssm.inner_size"))
    fields = {
        **_granite(meta, kwargs),
        # (HF's config spells "mamba" and "attention" so since transformers 5)
        "layer_types": ["linear_attention" if n == 0 else "full_attention" for n in kv_heads],
        "num_key_value_heads": max(kv_heads),
        "position_embedding_type": "rope" if meta.get("rope.scaling.finetuned", False) else None,
        "shared_intermediate_size": next(
            shape[0] for name, shape in shapes.items() if name.endswith(f".{shared}.weight")
        ),
        "num_local_experts": experts,
        "num_experts_per_tok": int(meta.get("expert_used_count", 0)),
        "mamba_n_heads": heads,
        "mamba_n_groups": int(meta.get("ssm.group_count")),
        "mamba_d_state": int(meta.get("ssm.state_size")),
        "mamba_d_conv": int(meta.get("ssm.conv_kernel")),
        "mamba_expand": inner / kwargs["hidden_size"],
        "mamba_d_head": inner // heads,
        "mamba_conv_bias": f"blk.{first_mamba}.ssm_conv1d.bias" in shapes,
        "mamba_proj_bias": f"blk.{first_mamba}.ssm_in.bias" in shapes,
    }
    if experts:
        fields["intermediate_size"] = kwargs["intermediate_size"]  # each expert's width
    return fields


def _undo_mamba_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if name.endswith(".mamba.A_log"):
        return torch.log(-tensor.reshape(-1))
    if name.endswith((".mamba.D", ".mamba.norm.weight")):
        return tensor.reshape(-1)
    return tensor


ARCHITECTURES = [
    GGUFArch(
        "granitehybrid",
        "GraniteMoeHybridForCausalLM",
        model_type="granitemoehybrid",
        layer_names=GRANITE_HYBRID_LAYER_NAMES,
        config=_granite_hybrid,
        permutes_qk=True,
        per_layer_kv_heads=True,
        tensor_fix=_undo_mamba_layout,
    ),
]
