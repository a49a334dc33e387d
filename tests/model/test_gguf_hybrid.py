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
from tests.model.gguf_writing import add_weight, finish
from tests.model.test_granitemoehybrid import granite_case  # noqa: F401 (a fixture)
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
        matrix = array.ndim == 2 and "conv.conv" not in name and "token_embd" not in gguf_name
        held[name] = add_weight(writer, gguf_name, array, qtype if matrix else None)
    finish(writer)
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


# HF name -> llama.cpp's, for granitehybrid (convert_hf_to_gguf.py's GraniteHybridModel:
# Mamba2Model's names in Mamba layers, GraniteMoeModel's in the others).
_GRANITE_TOP = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
_GRANITE_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mamba.in_proj": "ssm_in",
    "mamba.conv1d": "ssm_conv1d",
    "mamba.out_proj": "ssm_out",
    "mamba.norm": "ssm_norm",
    "block_sparse_moe.router.layer": "ffn_gate_inp",
    "block_sparse_moe.output_linear": "ffn_down_exps",
}


def _llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for its RoPE: each head's two halves interleaved."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _granite_tensors(config, state: dict):
    """(llama.cpp name, array) of each tensor, as the converter lays them out."""
    experts = config.num_local_experts
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        module, kind = name.rsplit(".", 1)
        if module in _GRANITE_TOP:
            yield f"{_GRANITE_TOP[module]}.{kind}", tensor
            continue
        _, _, layer, rest = module.split(".", 3)
        prefix = f"blk.{layer}"
        if rest == "mamba" and kind == "dt_bias":
            yield f"{prefix}.ssm_dt.bias", tensor
        elif rest == "mamba" and kind == "A_log":
            yield f"{prefix}.ssm_a", -torch.exp(tensor).reshape(-1, 1)
        elif rest == "mamba" and kind == "D":
            yield f"{prefix}.ssm_d", tensor.reshape(-1, 1)
        elif rest == "mamba.norm":
            yield f"{prefix}.ssm_norm.weight", tensor.reshape(config.mamba_n_groups, -1)
        elif rest == "mamba.conv1d" and kind == "weight":
            yield f"{prefix}.ssm_conv1d.weight", tensor.squeeze(1)
        elif rest in ("shared_mlp.input_linear", "block_sparse_moe.input_linear"):
            gate, up = tensor.chunk(2, dim=-2)
            suffix = "exps" if rest.startswith("block") else "shexp" if experts else ""
            for part, value in (("gate", gate), ("up", up)):
                yield f"{prefix}.ffn_{part}{'_' + suffix if suffix else ''}.weight", value
        elif rest == "shared_mlp.output_linear":
            yield f"{prefix}.ffn_down{'_shexp' if experts else ''}.weight", tensor
        elif rest == "self_attn.q_proj":
            yield f"{prefix}.attn_q.weight", _llama_cpp_permute(tensor, config.num_attention_heads)
        elif rest == "self_attn.k_proj":
            yield f"{prefix}.attn_k.weight", _llama_cpp_permute(tensor, config.num_key_value_heads)
        else:
            yield f"{prefix}.{_GRANITE_LAYER[rest]}.{kind}", tensor


def write_granite_hybrid_gguf(path: str, folder: str) -> None:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    writer = gguf.GGUFWriter(path, "granitehybrid")
    mamba = [t in ("mamba", "linear_attention") for t in config.layer_types]
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([0 if m else config.num_key_value_heads for m in mamba])
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_scaling_finetuned(config.position_embedding_type == "rope")
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)
    if config.num_local_experts:
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_ssm_inner_size(int(config.mamba_expand * config.hidden_size))
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    state = load_file(f"{folder}/model.safetensors")
    for name, tensor in _granite_tensors(config, state):
        writer.add_tensor(name, tensor.float().contiguous().numpy())
    finish(writer)


def test_granite_hybrid_gguf_config_and_greedy_outputs(tmp_path, granite_case):  # noqa: F811
    from transformers import AutoConfig

    import tests.model.test_granitemoehybrid as granite

    folder, expected = granite_case
    path = str(tmp_path / "granite-h.gguf")
    write_granite_hybrid_gguf(path, folder)
    config, hf_config = load_hf_config(path), AutoConfig.from_pretrained(folder)
    assert config.architectures == ["GraniteMoeHybridForCausalLM"]
    for field in (
        "layer_types",
        "num_key_value_heads",
        "position_embedding_type",
        "shared_intermediate_size",
        "num_local_experts",
        "mamba_n_heads",
        "mamba_n_groups",
        "mamba_d_state",
        "mamba_d_conv",
        "mamba_expand",
        "mamba_conv_bias",
        "embedding_multiplier",
        "residual_multiplier",
        "attention_multiplier",
        "logits_scaling",
    ):
        assert getattr(config, field) == getattr(hf_config, field), field
    _, outputs = granite.generate(path, tokenizer=folder, max_num_batched_tokens=7)
    granite.assert_matches_hf(outputs, expected)


# HF name -> llama.cpp's, for qwen35 (convert_hf_to_gguf.py's Qwen3.5 classes: Qwen3Next's
# conversion, plus the value heads reordered from grouped to tiled where a key head has
# several).
_QWEN35_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # qwen35moe: the router, the shared expert and its gate (Qwen2-MoE's names).
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_QWEN35_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _tiled(tensor: torch.Tensor, dim: int, key_heads: int, head_dim: int) -> torch.Tensor:
    """Value heads along dim from HF's grouped order ([k0v0, k0v1, k1v0, k1v1]) to
    llama.cpp's tiled one ([k0v0, k1v0, k0v1, k1v1]): tiled slot s holds grouped head
    (s % key_heads) * ratio + s // key_heads."""
    heads = tensor.shape[dim] // head_dim
    ratio = heads // key_heads
    slots = torch.arange(heads)
    grouped = (slots % key_heads) * ratio + slots // key_heads
    rows = (grouped[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)
    return tensor.index_select(dim, rows)


def _qwen35_value_order(state: dict, c) -> dict:
    """The state with its DeltaNet value heads in llama.cpp's tiled order."""
    if c.linear_num_value_heads == c.linear_num_key_heads:
        return state
    keys, dv = c.linear_num_key_heads, c.linear_value_head_dim
    qk = 2 * keys * c.linear_key_head_dim
    out = {}
    for name, t in state.items():
        if ".linear_attn." in name:
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                t = torch.cat([t[:qk], _tiled(t[qk:], 0, keys, dv)])
            elif name.endswith("in_proj_z.weight"):
                t = _tiled(t, 0, keys, dv)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                t = _tiled(t, 0, keys, 1)
            elif name.endswith("out_proj.weight"):
                t = _tiled(t, 1, keys, dv)
        out[name] = t
    return out


EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def _split_qkvz(tensor: torch.Tensor, c) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz ([q, k, v, z] per key head) as llama.cpp's attn_qkv (all
    q, all k, all v) and attn_gate (all z); the value heads stay grouped."""
    keys, dk = c.linear_num_key_heads, c.linear_key_head_dim
    dv = c.linear_num_value_heads // keys * c.linear_value_head_dim
    heads = tensor.reshape(keys, 2 * dk + 2 * dv, -1)
    q, k, v, z = (
        heads[:, :dk],
        heads[:, dk : 2 * dk],
        heads[:, 2 * dk : 2 * dk + dv],
        heads[:, 2 * dk + dv :],
    )
    flat = [x.reshape(-1, tensor.shape[-1]) for x in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def _qwen35_tensors(state: dict, c=None):
    for name, tensor in state.items():
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = tensor + 1  # llama.cpp stores the zero-centred norms' weights as 1 + w
        module, kind = name.rsplit(".", 1)
        if module in _QWEN35_TOP:
            yield f"{_QWEN35_TOP[module]}.{kind}", tensor
            continue
        _, _, layer, rest = module.split(".", 3)
        if ".mlp.experts." in name:  # saved expert by expert: llama.cpp stacks them
            continue
        if rest == "mlp.gate":
            for proj, gguf_name in EXPERT_NAMES.items():
                expert = f"model.layers.{layer}.mlp.experts.{{}}.{proj}.weight"
                count = sum(1 for n in state if n.startswith(f"model.layers.{layer}.mlp.experts."))
                stacked = [state[expert.format(e)] for e in range(count // 3)]
                yield f"blk.{layer}.{gguf_name}.weight", torch.stack(stacked)
        if rest == "linear_attn.in_proj_qkvz":
            qkv, z = _split_qkvz(tensor, c)
            yield f"blk.{layer}.attn_qkv.{kind}", qkv
            yield f"blk.{layer}.attn_gate.{kind}", z
        elif rest == "linear_attn.in_proj_ba":
            yield f"blk.{layer}.ssm_ba.{kind}", tensor  # as HF's: [b, a] per key head
        elif rest == "mlp.shared_expert_gate":
            yield f"blk.{layer}.ffn_gate_inp_shexp.{kind}", tensor.reshape(-1)  # a vector
        elif kind == "A_log":
            yield f"blk.{layer}.ssm_a", -torch.exp(tensor)
        elif kind == "dt_bias":
            yield f"blk.{layer}.ssm_dt.bias", tensor
        elif rest == "linear_attn.conv1d":
            yield f"blk.{layer}.ssm_conv1d.{kind}", tensor.squeeze(1)
        else:
            yield f"blk.{layer}.{_QWEN35_LAYER[rest]}.{kind}", tensor


def write_qwen35_gguf(path: str, folder: str) -> None:
    """A qwen35 (qwen35moe with experts) GGUF of the checkpoint in folder as llama.cpp's
    converter writes one."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    moe = getattr(c, "num_experts", 0) > 0
    arch = "qwen3next" if c.model_type == "qwen3_next" else "qwen35moe" if moe else "qwen35"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    if arch == "qwen3next":  # with a dense MLP in its mlp_only_layers
        writer.add_feed_forward_length(c.intermediate_size)
    if moe:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    else:
        writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_full_attention_interval(c.layer_types.index("full_attention") + 1)
    state = load_file(f"{folder}/model.safetensors")
    if arch != "qwen3next":  # llama.cpp's Qwen3.5 classes reorder value heads, Qwen3-Next's not
        state = _qwen35_value_order(state, c)
    for name, tensor in _qwen35_tensors(state, c):
        writer.add_tensor(name, tensor.float().contiguous().numpy())
    finish(writer)


@pytest.fixture(scope="module", params=[2, 4], ids=["one-value-head-a-key", "two-a-key"])
def qwen35_case(request, tmp_path_factory, smollm2_tokenizer):
    """A tiny Qwen3.5 with one or two value heads per key head (two: the file holds them in
    llama.cpp's tiled order), and HF's greedy outputs."""
    folder = str(tmp_path_factory.mktemp("tiny-qwen35"))
    _, expected = tiny_qwen_reference(
        folder, "qwen3.5", smollm2_tokenizer, linear_num_key_heads=2,
        linear_num_value_heads=request.param,
    )  # fmt: skip
    return folder, expected


def tiny_qwen_reference(folder: str, arch: str, tokenizer, **config):
    """A tiny checkpoint of a Qwen3-Next-family arch saved in folder with the bundled
    tokenizer: its HF model and HF's greedy tokens and logprobs for the shared prompts."""
    import transformers

    from minivllm.tokenizer import load_tokenizer
    from tests.model.test_hf_parity_archs import hf_greedy_with_logprobs
    from tests.model.test_qwen3_next import MAX_NEW, PROMPTS, hf_model

    hf_model(
        arch,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **config,
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = load_tokenizer(folder)
    return hf, {p: hf_greedy_with_logprobs(hf, ids.encode(p), MAX_NEW) for p in PROMPTS}


def test_qwen35_gguf_config_and_greedy_outputs(tmp_path, qwen35_case):
    from transformers import AutoConfig

    import tests.model.test_qwen3_next as qwen

    folder, expected = qwen35_case
    path = str(tmp_path / "qwen35.gguf")
    write_qwen35_gguf(path, folder)
    config, hf_config = load_hf_config(path), AutoConfig.from_pretrained(folder)
    assert config.architectures == ["Qwen3_5ForCausalLM"]
    for field in (
        "layer_types",
        "head_dim",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_value_head_dim",
    ):
        assert getattr(config, field) == getattr(hf_config, field), field
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    tiled = hf_config.linear_num_value_heads > hf_config.linear_num_key_heads
    assert config.linear_value_head_order == ("tiled" if tiled else "grouped")
    _, outputs = qwen.generate(path, tokenizer=folder, max_num_batched_tokens=7)
    qwen.assert_matches_hf(outputs, expected)


@pytest.mark.parametrize("arch", ["qwen3.5-moe", "qwen3-next"])
def test_hybrid_moe_gguf_config_and_greedy_outputs(tmp_path, smollm2_tokenizer, arch):
    """Qwen3.5-MoE (experts, a gated shared expert; two value heads a key head, tiled) and
    Qwen3-Next (the same with a dense layer; in_proj_qkvz split, value heads grouped)."""
    import tests.model.test_qwen3_next as qwen

    folder = str(tmp_path / "tiny-qwen35moe")
    hf, expected = tiny_qwen_reference(folder, arch, smollm2_tokenizer)
    path = str(tmp_path / "qwen35moe.gguf")
    write_qwen35_gguf(path, folder)
    config, hf_config = load_hf_config(path), hf.config
    assert config.architectures == [type(hf).__name__]
    for field in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "linear_num_key_heads",
        "linear_num_value_heads",
    ):
        assert getattr(config, field) == getattr(hf_config, field), field
    assert config.linear_value_head_order == ("grouped" if arch == "qwen3-next" else "tiled")
    _, outputs = qwen.generate(path, tokenizer=folder, max_num_batched_tokens=7)
    qwen.assert_matches_hf(outputs, expected)
