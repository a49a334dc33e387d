"""OLMo 2 (and OLMo 3, which llama.cpp writes as olmo2 with a window), OLMoE."""

from __future__ import annotations

from typing import Any

from minivllm.model.loader.gguf_arch.base import (
    GGUFArch,
    GGUFMeta,
    f32_decimal,
    layer_types,
)
from minivllm.model.loader.gguf_arch.gemma import GEMMA_LAYER_NAMES
from minivllm.model.loader.gguf_arch.qwen import sparse_moe_fields


def _olmo2(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3: the windowed layers (three of four by default), whose RoPE is plain (base
    rope.freq_base_swa where given), the file's scaling (YaRN) on the full-attention layers
    only, as llama.cpp and HF's Olmo3 do."""
    if meta.get("attention.sliding_window", None) is None:
        return {}
    theta = f32_decimal(meta.get("rope.freq_base_swa", kwargs["rope_parameters"]["rope_theta"]))
    return {
        "architectures": ["Olmo3ForCausalLM"],
        "sliding_window": int(meta.get("attention.sliding_window")),
        "layer_types": layer_types(meta, kwargs["num_hidden_layers"], every=4),
        "rope_parameters": {
            "full_attention": kwargs["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": theta},
        },
        "model_type": "olmo3",
    }


def _olmoe(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """OLMoE's experts are feed_forward_length wide (its config's intermediate_size)."""
    return sparse_moe_fields(meta, kwargs, norm_topk_prob=False)


ARCHITECTURES = [
    # Norms after the sublayers only, under Gemma's names.
    GGUFArch("olmo2", "Olmo2ForCausalLM", layer_names=GEMMA_LAYER_NAMES, config=_olmo2),
    GGUFArch("olmoe", "OlmoeForCausalLM", config=_olmoe),
]
