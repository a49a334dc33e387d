"""Hybrid models' GGUF files (issue 50): each written from a tiny HF checkpoint the way
llama.cpp's converter lays out the family (written here, independently of the loader's
tables), read by the engine's GGUF loader: its config equals HF's where the file holds
it, and greedy tokens and logprobs equal HF's on the checkpoint's weights (prompts in odd
chunks, batched), also with quantized matrices kept as blocks (the float32 kernel)."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import gguf_kernels
from minivllm.model.loader import load_hf_config
from tests.model.test_lfm2 import (  # noqa: F401 (the fixtures hf_expected, lfm2_model)
    assert_matches_hf,
    generate,
    hf_expected,
    lfm2_model,
)

Q8_0 = gguf_kernels.SUPPORTED_TYPES["Q8_0"]

# HF name -> llama.cpp's, for lfm2 (convert_hf_to_gguf.py's LFM2Model and gguf-py's
# tensor map).
_LFM2_TOP = {
    "model.embed_tokens": "token_embd",
    "model.embedding_norm": "token_embd_norm",
    "lm_head": "output",
}
_LFM2_LAYER = {
    "operator_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm",
    "conv.in_proj": "shortconv.in_proj",
    "conv.conv": "shortconv.conv",
    "conv.out_proj": "shortconv.out_proj",
    "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down",
}


def _lfm2_gguf_name(name: str) -> str:
    module, kind = name.rsplit(".", 1)
    if module in _LFM2_TOP:
        return f"{_LFM2_TOP[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_LFM2_LAYER[rest]}.{kind}"


def write_lfm2_gguf(path: str, folder: str, qtype: str | None = None) -> dict:
    """An lfm2 GGUF of the checkpoint in ``folder`` as llama.cpp's converter writes one;
    qtype quantizes the 2-D matrices but the embedding. Returns the weights the file holds,
    dequantized, under HF's names."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    state = load_file(f"{folder}/model.safetensors")
    writer = gguf.GGUFWriter(path, "lfm2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    kv_heads = [config.num_key_value_heads if t != "conv" else 0 for t in config.layer_types]
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_shortconv_l_cache(config.conv_L_cache)
    writer.add_feed_forward_length(state["model.layers.0.feed_forward.w1.weight"].shape[0])
    held = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if "conv.conv" in name:
            tensor = tensor.squeeze(1)  # llama.cpp's conv op takes [channels, taps]
        array = tensor.float().numpy()
        gguf_name = _lfm2_gguf_name(name)
        if qtype is None or array.ndim != 2 or "conv.conv" in name or "token_embd" in gguf_name:
            writer.add_tensor(gguf_name, array)
            held[name] = tensor
            continue
        ggml_type = gguf.GGMLQuantizationType[qtype]
        blocks = gguf.quants.quantize(array, ggml_type)
        writer.add_tensor(gguf_name, blocks, raw_dtype=ggml_type)
        held[name] = torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def test_lfm2_gguf_config_and_greedy_outputs(tmp_path, lfm2_model, hf_expected):  # noqa: F811
    from transformers import AutoConfig

    path = str(tmp_path / "lfm2.gguf")
    write_lfm2_gguf(path, lfm2_model)
    config, hf_config = load_hf_config(path), AutoConfig.from_pretrained(lfm2_model)
    assert config.architectures == ["Lfm2ForCausalLM"]
    assert config.layer_types == hf_config.layer_types  # from the per-layer KV heads
    assert config.head_dim == 16  # the first attention layer's q rows (layer 0 has none)
    for field in ("num_key_value_heads", "conv_L_cache", "norm_eps", "hidden_size"):
        assert getattr(config, field) == getattr(hf_config, field), field
    assert config.intermediate_size == 128  # the MLP's adjusted width, as written
    _, outputs = generate(path, tokenizer=lfm2_model, max_num_batched_tokens=7, max_num_seqs=4)
    assert_matches_hf(outputs, hf_expected)


@pytest.mark.slow  # ~30 s: HF's reference on the file's weights, then the engine
@pytest.mark.skipif(gguf_kernels.load_gguf_kernels() is None, reason="no C compiler")
def test_quantized_lfm2_gguf_gives_hf_greedy_outputs_on_its_weights(
    tmp_path,
    lfm2_model,  # noqa: F811
    smollm2_tokenizer,
    monkeypatch,
):
    import transformers

    from minivllm.model.layers.quantization.gguf import GGUFConfig
    from minivllm.model.loader import iter_weights
    from minivllm.model.registry import resolve_model_class
    from minivllm.platforms import get_platform
    from tests.model.test_lfm2 import MAX_NEW, PROMPTS, hf_greedy_with_logprobs

    path = str(tmp_path / "lfm2-q8.gguf")
    held = write_lfm2_gguf(path, lfm2_model, "Q8_0")
    hf = transformers.AutoModelForCausalLM.from_pretrained(lfm2_model, dtype=torch.float32)
    hf.load_state_dict({k: v.reshape(hf.state_dict()[k].shape) for k, v in held.items()})
    hf.eval()
    expected = {
        p: hf_greedy_with_logprobs(hf, smollm2_tokenizer.encode(p), MAX_NEW) for p in PROMPTS
    }
    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")  # the exact products of the blocks
    llm, outputs = generate(
        path, tokenizer=lfm2_model, quantization="gguf", max_num_batched_tokens=7
    )
    assert_matches_hf(outputs, expected)

    # The convolution layers' projections and the attention's are the file's blocks.
    config = load_hf_config(path)
    backend = get_platform("cpu").create_attn_backend(16)
    model = resolve_model_class(config)(config, backend, quant_config=GGUFConfig())
    model.load_weights(iter_weights(path, torch.float32, "gguf"))
    conv, attention = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    for weight in (conv.in_proj.weight, conv.out_proj.weight, attention.qkv_proj.weight):
        assert weight.numel() == 0  # no float copy
        assert {t.qtype for _, t in weight.quantized.segments} == {Q8_0}
