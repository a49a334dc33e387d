"""Qwen3.5 dense (qwen35) and with experts (qwen35moe), and Qwen3-Next (qwen3next): Gated
DeltaNet layers and, every few layers, gated full attention.

llama.cpp's converter names the DeltaNet's projections attn_qkv (in_proj_qkv), attn_gate
(in_proj_z), ssm_beta and ssm_alpha (in_proj_b / in_proj_a), stores A as -exp(A_log),
squeezes the convolution's taps, and adds 1 to every zero-centred norm weight (not the
DeltaNet's output norm, a plain scale). Where a key head has several value heads it also
reorders the value heads from HF's grouped order (value head j belongs to key head
j // ratio) to a tiled one (j % key heads, for ggml's broadcast), in every per-value-head
row and in the output projection's columns. Quantized blocks cannot undo the columns' order
(K-quants' 256-wide superblocks span heads), so the tensors stay as written and the config
says linear_value_head_order="tiled": the DeltaNet layer pairs value head j with key head
j % key heads, and everything else per value head is already consistently in that order.
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm.model.loader.gguf_arch.base import LAYER_NAMES, GGUFArch, GGUFMeta
from minivllm.model.loader.gguf_arch.qwen import sparse_moe_fields

QWEN35_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}


def _qwen35(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    layers = kwargs["num_hidden_layers"]
    interval = int(meta.get("full_attention_interval", 4))
    value_heads = int(meta.get("ssm.time_step_rank"))
    rope = dict(kwargs["rope_parameters"])
    rope["partial_rotary_factor"] = int(meta.get("rope.dimension_count")) / kwargs["head_dim"]
    return {
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        "linear_conv_kernel_dim": int(meta.get("ssm.conv_kernel")),
        "linear_key_head_dim": int(meta.get("ssm.state_size")),
        "linear_num_key_heads": int(meta.get("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(meta.get("ssm.inner_size")) // value_heads,
        # llama.cpp's converter reorders value heads only where there are more than key heads.
        "linear_value_head_order": (
            "tiled" if value_heads != int(meta.get("ssm.group_count")) else "grouped"
        ),
        "rope_parameters": rope,
    }


def _qwen35moe(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE: Qwen3.5's layers with experts (renormalised top-k, as HF's and llama.cpp's
    qwen35moe) and a gated shared expert in every layer, Qwen2-MoE's tensor names."""
    fields = {**_qwen35(meta, kwargs), **sparse_moe_fields(meta, kwargs, norm_topk_prob=True)}
    layers = range(kwargs["num_hidden_layers"])
    first_sparse = next(i for i in layers if i not in fields["mlp_only_layers"])
    rows = meta.shapes[f"blk.{first_sparse}.ffn_gate_shexp.weight"][0]
    fields["shared_expert_intermediate_size"] = int(
        meta.get("expert_shared_feed_forward_length", rows)
    )
    return fields


def _qwen3next(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next: Qwen3.5-MoE's fields, but its converter splits HF's per-key-head
    in_proj_qkvz into attn_qkv / attn_gate without reordering the value heads (grouped, as
    HF's), and keeps in_proj_ba whole (ssm_ba), which the model splits as HF's."""
    return {**_qwen35moe(meta, kwargs), "linear_value_head_order": "grouped"}


def _undo_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if name.endswith(".linear_attn.A_log"):
        return torch.log(-tensor.reshape(-1))
    if name.endswith(".linear_attn.conv1d.weight"):
        return tensor.unsqueeze(1)  # HF's Conv1d [channels, 1, taps]
    if name.endswith("norm.weight") and not name.endswith(".linear_attn.norm.weight"):
        return tensor - 1  # the zero-centred norms' weights, stored with the 1 added
    return tensor


ARCHITECTURES = [
    GGUFArch(
        "qwen35",
        "Qwen3_5ForCausalLM",
        model_type="qwen3_5_text",
        layer_names=QWEN35_LAYER_NAMES,
        config=_qwen35,
        tensor_fix=_undo_layout,
    ),
    GGUFArch(
        "qwen3next",
        "Qwen3NextForCausalLM",
        model_type="qwen3_next",
        layer_names={**QWEN35_LAYER_NAMES, "ssm_ba": "linear_attn.in_proj_ba"},
        config=_qwen3next,
        tensor_fix=_undo_layout,
    ),
    GGUFArch(
        "qwen35moe",
        "Qwen3_5MoeForCausalLM",
        model_type="qwen3_5_moe_text",
        layer_names=QWEN35_LAYER_NAMES,
        config=_qwen35moe,
        tensor_fix=_undo_layout,
    ),
]
