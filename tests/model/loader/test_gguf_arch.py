"""Each GGUF architecture is one GGUFArch in a family module of gguf_arch/: the engine
serves the Hugging Face class it names, and the loader reads its names through it."""

from __future__ import annotations

import pytest

from minivllm.model.loader.gguf import hf_name
from minivllm.model.loader.gguf_arch import ARCHITECTURES, LAYER_NAMES
from minivllm.model.registry import MODEL_REGISTRY


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_architecture_names_a_served_model_class(name):
    arch = ARCHITECTURES[name]
    assert arch.name == name
    assert arch.hf_architecture in MODEL_REGISTRY


def test_names_come_from_the_architectures_own_map():
    assert hf_name("blk.3.attn_qkv.weight", "phi3") == "model.layers.3.self_attn.qkv_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight", "gemma3").endswith("pre_feedforward_layernorm.weight")
    assert hf_name("blk.0.ffn_norm.weight", "llama").endswith("post_attention_layernorm.weight")
    # An architecture without a map of its own reads llama.cpp's standard names.
    assert ARCHITECTURES["qwen3"].layer_names is LAYER_NAMES
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        hf_name("blk.0.attn_qkv.weight", "llama")
