"""LFM2: gated short convolutions in most layers, GQA attention in the others.

llama.cpp writes the layers' kinds as the per-layer KV head count (0 for a convolution
layer), the MLP width already adjusted (HF's ``block_auto_adjust_ff_dim`` applied), each
convolution's taps squeezed to [channels, taps], and the final norm as ``token_embd_norm``.
"""

from __future__ import annotations

from typing import Any

from minivllm.model.loader.gguf_arch.base import (
    LAYER_NAMES,
    GGUFArch,
    GGUFMeta,
    kv_heads_per_layer,
)

LFM2_LAYER_NAMES = {
    **LAYER_NAMES,
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.conv": "conv.conv",
    "shortconv.out_proj": "conv.out_proj",
}


def _lfm2(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    kv_heads = kv_heads_per_layer(meta)
    return {
        "layer_types": ["conv" if n == 0 else "full_attention" for n in kv_heads],
        "num_key_value_heads": max(kv_heads),
        "conv_L_cache": int(meta.get("shortconv.l_cache")),
        "conv_bias": False,
        "norm_eps": kwargs["rms_norm_eps"],
        "block_auto_adjust_ff_dim": False,  # feed_forward_length is the MLP's own width
    }


ARCHITECTURES = [
    GGUFArch(
        "lfm2",
        "Lfm2ForCausalLM",
        layer_names=LFM2_LAYER_NAMES,
        config=_lfm2,
        per_layer_kv_heads=True,
    ),
]
