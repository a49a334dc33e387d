"""GLM-4: a norm on each side of both sublayers, gate/up in one matrix, partial RoPE."""

from __future__ import annotations

from typing import Any

from minivllm.model.loader.gguf_arch.base import LAYER_NAMES, GGUFArch, GGUFMeta

# Gemma's four norms under GLM's names; gate/up in the one named ffn_up.
_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_self_attn_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",
}


def _glm4(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """RoPE on part of each head: rope.dimension_count of head_dim."""
    rope = kwargs["rope_parameters"]
    rope["partial_rotary_factor"] = int(meta.get("rope.dimension_count")) / kwargs["head_dim"]
    return {}


ARCHITECTURES = [
    GGUFArch(
        "glm4",
        "Glm4ForCausalLM",
        layer_names=_LAYER_NAMES,
        config=_glm4,
        attention_bias_in_file=True,
    )
]
