"""gpt-oss: experts in every layer, attention sinks, windowed layers, YaRN."""

from __future__ import annotations

from typing import Any

from minivllm.model.loader.gguf_arch.base import LAYER_NAMES, GGUFArch, GGUFMeta, layer_types

# llama.cpp hard-codes its SwiGLU's alpha and limit (HF's config defaults).
_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
# The norm before the MLP is named as Gemma's after attention; a router with a bias; each
# head's attention sink (a vector, named without .weight in HF).
_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
    "attn_sinks": "self_attn.sinks",
}


def _gpt_oss(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields under its HF config's names. The file says which layers are windowed
    (a flag per layer, or one layer in n not; by default the even ones, as HF's configs);
    YaRN's ramp is not rounded to whole dimensions (HF's released configs: truncate false;
    llama.cpp rounds)."""
    get = meta.get
    rope = dict(kwargs["rope_parameters"])
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    return {
        **_SWIGLU,
        "rope_parameters": rope,
        "intermediate_size": int(get("expert_feed_forward_length")),
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": layer_types(meta, kwargs["num_hidden_layers"], every=2),
        "attention_bias": True,
    }


ARCHITECTURES = [
    GGUFArch(
        "gpt-oss",
        "GptOssForCausalLM",
        model_type="gpt_oss",
        layer_names=_LAYER_NAMES,
        config=_gpt_oss,
    )
]
