"""Gemma 2 and 3 (text): four norms a layer, stored with the 1 of Gemma's (1 + w) added."""

from __future__ import annotations

from typing import Any

from minivllm.model.loader.gguf_arch.base import LAYER_NAMES, GGUFArch, GGUFMeta

# Gemma's four norms a layer: ffn_norm is the one before the MLP here (OLMo 2 has the two
# after the sublayers under these names).
GEMMA_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gemma(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's or 3's fields, as transformers' GGUF loading fills their configs.

    The file names the (global) RoPE base, the window and the soft caps; the rest are the
    models' defaults: every sixth layer global in Gemma 3 (whose local layers rotate with
    base 10,000), every second in Gemma 2; tanh-GELU. llama.cpp scales queries by
    1/sqrt(head_dim), except for the 27B models (Gemma 2: 46 layers, Gemma 3: 62):
    1/sqrt(hidden / heads).
    """
    gemma2 = meta.arch == "gemma2"
    rope = kwargs["rope_parameters"]
    layers = kwargs["num_hidden_layers"]
    scalar = kwargs["head_dim"]
    if layers == (46 if gemma2 else 62):
        scalar = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    pattern = 2 if gemma2 else 6
    if not gemma2:
        rope = {
            "full_attention": rope,  # rope scaling, if any, applies to global layers only
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    return {
        "rope_parameters": rope,
        "sliding_window": int(meta.get("attention.sliding_window")),
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": meta.get("final_logit_softcapping", None),
        "attn_logit_softcapping": meta.get("attn_logit_softcapping", None),
    }


_GEMMA = {"layer_names": GEMMA_LAYER_NAMES, "config": _gemma, "norms_plus_one": True}
ARCHITECTURES = [
    GGUFArch("gemma2", "Gemma2ForCausalLM", **_GEMMA),
    GGUFArch("gemma3", "Gemma3ForCausalLM", model_type="gemma3_text", **_GEMMA),
]
