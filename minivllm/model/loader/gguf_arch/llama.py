"""Llama and the families llama.cpp writes in its layout (its converters subclass the llama
one): q and k rows permuted for its RoPE. Llama files with experts are Mixtral's."""

from __future__ import annotations

from typing import Any

from minivllm.model.loader.gguf_arch.base import GGUFArch, GGUFMeta, f32_decimal

# SmolLM3: RoPE in three layers of four, the fourth without (llama.cpp fixes the step).
_SMOLLM3_NO_ROPE_STEP = 4


def _experts(meta: GGUFMeta) -> dict[str, Any]:
    """The experts under Mixtral's names; they are feed_forward_length wide (the config's
    intermediate_size)."""
    return {
        "num_local_experts": int(meta.get("expert_count")),
        "num_experts_per_tok": int(meta.get("expert_used_count")),
    }


def _llama(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    if not meta.get("expert_count", 0):
        return {}
    # Mixtral's files hold no window.
    return {
        "architectures": ["MixtralForCausalLM"],
        "sliding_window": None,
        **_experts(meta),
        "model_type": "mixtral",
    }


def _smollm3(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    step = _SMOLLM3_NO_ROPE_STEP
    return {
        "no_rope_layer_interval": step,
        "no_rope_layers": [int((i + 1) % step != 0) for i in range(kwargs["num_hidden_layers"])],
    }


def _granite(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Granite's four scales under its HF config's names; llama.cpp reads a missing
    attention scale as 1/sqrt(head_dim) and the others as 1."""
    return {
        "embedding_multiplier": f32_decimal(meta.get("embedding_scale", 1.0)),
        "residual_multiplier": f32_decimal(meta.get("residual_scale", 1.0)),
        "attention_multiplier": f32_decimal(
            meta.get("attention.scale", 0.0) or kwargs["head_dim"] ** -0.5
        ),
        "logits_scaling": f32_decimal(meta.get("logit_scale", 1.0)),
    }


def _granitemoe(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    fields = _granite(meta, kwargs)
    if "blk.0.ffn_gate_shexp.weight" in meta.shapes:
        raise NotImplementedError(
            f"Granite MoE with a shared expert (GraniteMoeShared): {meta.path}"
        )
    if meta.get("expert_count", 0):
        fields.update(_experts(meta))
    return fields


_LAYOUT = {"permutes_qk": True, "attention_bias_in_file": True}
ARCHITECTURES = [
    GGUFArch("llama", "LlamaForCausalLM", config=_llama, **_LAYOUT),
    GGUFArch("smollm3", "SmolLM3ForCausalLM", config=_smollm3, **_LAYOUT),
    GGUFArch("granite", "GraniteForCausalLM", config=_granite, **_LAYOUT),
    GGUFArch("granitemoe", "GraniteMoeForCausalLM", config=_granitemoe, **_LAYOUT),
]
