"""Gemma 4 (text): per-layer head sizes and KV head counts, layers that read earlier
layers' K/V, per-layer embeddings, and (26B-A4B) experts beside each MLP."""

from __future__ import annotations

from typing import Any

import numpy as np

from minivllm.model.loader.gguf_arch.base import GGUFArch, GGUFMeta, f32_decimal, layer_types
from minivllm.model.loader.gguf_arch.gemma import GEMMA_LAYER_NAMES

# Gemma's four norms a layer (no 1 added); beside the MLP of a 26B-A4B layer, the router
# (its scale vectors named as llama.cpp's) and the experts (gate/up fused or apart), with a
# norm for each branch; the per-layer embeddings' gate, projection and norm; the layer's
# output scale.
_LAYER_NAMES = {
    **GEMMA_LAYER_NAMES,
    "ffn_gate_inp": "router.proj",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_gate_exps": "experts.gate_proj",
    "ffn_up_exps": "experts.up_proj",
    "ffn_down_exps": "experts.down_proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale.weight": "layer_scalar",
}


def _gemma4(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's fields, as llama.cpp's converter writes them: key_length is the global
    layers' head size (key_length_swa the others'), head_count_kv one count per layer when
    the global layers have their own; a flag per layer for the windowed ones; the MLPs of
    the layers sharing K/V twice as wide where feed_forward_length says so; values taken
    from the keys where a global layer has no attn_v. The global layers' proportional RoPE
    is a rope_freqs tensor: factor 1 for the pairs that turn, 1e30 (no turn) for the rest."""
    get, shapes = meta.get, meta.shapes
    layers = kwargs["num_hidden_layers"]
    types = layer_types(meta, layers, every=6)
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    kv_heads = get("attention.head_count_kv")
    if not isinstance(kv_heads, np.ndarray):
        kv_heads = np.full(layers, kv_heads)
    global_head_dim = kwargs["head_dim"]
    head_dim = int(get("attention.key_length_swa", global_head_dim))
    feed_forward = get("feed_forward_length")
    shared = int(get("attention.shared_kv_layers", 0))
    rope = {"rope_type": "proportional", "rope_theta": kwargs["rope_parameters"]["rope_theta"]}
    if "rope_freqs.weight" in shapes:
        turned = int((meta.f32_values("rope_freqs.weight") == 1.0).sum())
        rope["partial_rotary_factor"] = 2 * turned / global_head_dim
    swa_theta = f32_decimal(get("rope.freq_base_swa", 10000.0))
    per_layer = int(get("embedding_length_per_layer_input", 0))
    config: dict[str, Any] = {
        "head_dim": head_dim,
        "num_key_value_heads": int(kv_heads[sliding[0]] if sliding else kv_heads[0]),
        # The global layers' own, as HF's config holds them (transformers' per-layer view).
        "per_layer_config": {
            i: {"head_dim": global_head_dim, "num_key_value_heads": int(kv_heads[i])} for i in full
        },
        "attention_k_eq_v": bool(full) and f"blk.{full[0]}.attn_v.weight" not in shapes,
        "layer_types": types,
        "sliding_window": int(get("attention.sliding_window")),
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": isinstance(feed_forward, np.ndarray)
        and len(set(feed_forward.tolist())) > 1,
        "rope_parameters": {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": swa_theta},
        },
        "hidden_size_per_layer_input": per_layer,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": get("final_logit_softcapping", None),
    }
    if per_layer:
        config["vocab_size_per_layer_input"] = shapes["per_layer_token_embd.weight"][0]
    if get("expert_count", 0):
        config.update(
            enable_moe_block=True,
            num_experts=int(get("expert_count")),
            top_k_experts=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
        )
    return config


ARCHITECTURES = [
    GGUFArch(
        "gemma4",
        "Gemma4ForCausalLM",
        model_type="gemma4_text",
        layer_names=_LAYER_NAMES,
        config=_gemma4,
        per_layer_kv_heads=True,
        rope_freqs_divide=False,  # its proportional RoPE, read above
    )
]
