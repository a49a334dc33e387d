"""Phi-3 (and Phi-3.5, Phi-4 mini): q/k/v in one matrix, gate/up in the one named ffn_up,
LongRoPE factors as tensors."""

from __future__ import annotations

import math
from typing import Any

from minivllm.model.loader.gguf_arch.base import LAYER_NAMES, GGUFArch, GGUFMeta, f32_decimal

_LAYER_NAMES = {**LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def _phi3(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's fields, as its HF config holds them.

    llama.cpp's converter writes the trained context (rope.scaling.original_context_length),
    the rotated dimensions (partial rotary), the window (0 for none) and, for LongRoPE
    models (128k, Phi-3.5, Phi-4 mini), the long and short factor lists as tensors with
    their attention factor. llama.cpp itself ignores phi3's window; HF applies it, and so
    does this engine, as it does for the HF checkpoint.
    """
    get = meta.get
    context = kwargs["max_position_embeddings"]
    original = int(get("rope.scaling.original_context_length", context))
    rope = dict(kwargs["rope_parameters"])
    rope["partial_rotary_factor"] = (
        int(get("rope.dimension_count", kwargs["head_dim"])) / (kwargs["head_dim"])
    )
    if "rope_factors_long.weight" in meta.shapes:
        rope["rope_type"] = "longrope"
        rope["original_max_position_embeddings"] = original
        for kind in ("long", "short"):
            values = meta.f32_values(f"rope_factors_{kind}.weight")
            rope[f"{kind}_factor"] = [f32_decimal(v) for v in values]
        # HF's default from the stretch (max / original); set only where the file differs.
        factor = context / original
        default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        attention_factor = get("rope.scaling.attn_factor", None)
        if attention_factor is not None and abs(attention_factor - default) > 1e-6:
            rope["attention_factor"] = f32_decimal(attention_factor)
    return {
        "rope_parameters": rope,
        "original_max_position_embeddings": original,
        "sliding_window": int(get("attention.sliding_window", 0)) or None,
    }


ARCHITECTURES = [
    GGUFArch("phi3", "Phi3ForCausalLM", layer_names=_LAYER_NAMES, config=_phi3),
]
