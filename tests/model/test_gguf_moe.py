"""Mixture-of-experts GGUF files (llama.cpp's ``qwen3moe``, ``qwen2moe``, and ``llama``
files with experts: Mixtral): a router and every expert's matrices stacked in one 3D tensor a
projection, read dequantized or kept as blocks expert by expert.

Each file is written from a tiny HF checkpoint (tests/conftest.py: "qwen3-moe", whose
layer 1 is dense; "qwen2-moe"; "mixtral") the way llama.cpp's converter lays one out (written here,
independently of the loader's tables); the engine's greedy tokens on it equal HF's on the
checkpoint's weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.kernels import gguf_kernels
from minivllm.model.layers.quantization.gguf import GGUFConfig
from minivllm.model.loader import iter_weights, load_hf_config, read_gguf_header
from minivllm.model.registry import resolve_model_class
from minivllm.platforms import get_platform
from tests.conftest import write_tiny_checkpoint
from tests.model.test_gguf_phi3 import assert_f32_kernel_greedy_equals_hf, assert_greedy_equals_hf
from tests.model.test_loader import _TO_GGUF as _LLAMA_TO_GGUF
from tests.model.test_loader import _TOP, LLAMA_LAYOUT, _llama_cpp_permute
from tests.worker.test_cpu_graph import run

# HF module name -> llama.cpp tensor name, for qwen3moe: llama's, the router, the shared
# expert.
_TO_GGUF = {
    **_LLAMA_TO_GGUF,
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "block_sparse_moe.router": "ffn_gate_inp",  # Granite MoE's router
}
Q8_0, Q4_0 = gguf_kernels.SUPPORTED_TYPES["Q8_0"], gguf_kernels.SUPPORTED_TYPES["Q4_0"]


def _llama_cpp_tensors(state: dict, stacked: bool = True) -> dict[str, tuple[str, torch.Tensor]]:
    """llama.cpp name -> (HF name, tensor). HF holds the experts fused in memory
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]); the converter stacks
    each projection of every expert: ffn_gate_exps / ffn_up_exps [E, I, H], ffn_down_exps.
    stacked=False: as early Mixtral files, blk.N.ffn_gate.E.weight ... one an expert."""
    out = {}
    for name, tensor in state.items():
        module, kind = name.rsplit(".", 1)
        if module in _TOP:
            out[f"{_TOP[module]}.{kind}"] = (name, tensor)
            continue
        layer = module.split(".")[2]
        if not stacked and ".experts." in name:
            projections = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
            for e, matrix in enumerate(tensor):
                for proj, part in zip(projections, matrix.chunk(len(projections))):
                    out[f"blk.{layer}.ffn_{proj}.{e}.weight"] = (name, part)
        elif name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"] = (name, gate)
            out[f"blk.{layer}.ffn_up_exps.weight"] = (name, up)
        elif name.endswith("experts.down_proj"):
            out[f"blk.{layer}.ffn_down_exps.weight"] = (name, tensor)
        else:
            out[f"blk.{layer}.{_TO_GGUF[module.split('.', 3)[3]]}.{kind}"] = (name, tensor)
    return out


def write_qwen3moe_gguf(
    path: str,
    config,
    state: dict,
    qtypes: dict[str, str] | None = None,
    arch: str = "qwen3moe",
    stacked: bool = True,
):
    """A qwen3moe GGUF (or qwen2moe, olmoe, granitemoe; with arch="llama", a Mixtral one:
    q/k rows permuted as llama.cpp's llama converter does, as for granitemoe); qtypes
    quantizes the tensors whose
    llama.cpp name contains a key. Returns HF's state dict of the weights the file holds
    (dequantized)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch in ("qwen3moe", "qwen2moe"):
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_key_length(getattr(config, "head_dim", None) or head_dim)
        writer.add_value_length(getattr(config, "head_dim", None) or head_dim)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    # (an OLMoE file's experts are feed_forward_length wide, as Mixtral's and Granite's)
    llama_layout = arch in LLAMA_LAYOUT
    writer.add_expert_count(config.num_local_experts if llama_layout else config.num_experts)
    if arch == "granitemoe":
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    held = {name: tensor.clone() for name, tensor in state.items()}
    for gguf_name, (name, tensor) in _llama_cpp_tensors(state, stacked).items():
        array = tensor.numpy().astype(np.float32)
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            array = array.reshape(-1)  # llama.cpp's converter writes the [1, H] gate as a vector
        if llama_layout and ".q_proj." in name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif llama_layout and ".k_proj." in name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        qtype = next((t for part, t in (qtypes or {}).items() if part in gguf_name), None)
        if qtype is None:
            writer.add_tensor(gguf_name, array)
            continue
        ggml_type = gguf.GGMLQuantizationType[qtype]
        blocks = gguf.quants.quantize(array, ggml_type)
        writer.add_tensor(gguf_name, blocks, raw_dtype=ggml_type)
        back = torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type).copy())
        if "ffn_gate_exps" in gguf_name or "ffn_up_exps" in gguf_name:
            rows = back.shape[1]
            held[name].narrow(1, 0 if "gate" in gguf_name else rows, rows).copy_(back)
        else:
            held[name] = back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, smollm2_tokenizer):
    from transformers import Qwen3MoeForCausalLM

    folder = write_tiny_checkpoint(
        "qwen3-moe", str(tmp_path_factory.mktemp("qwen3-moe")), smollm2_tokenizer
    )
    hf = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


def test_qwen3moe_gguf_config_weights_and_greedy_outputs(tmp_path, qwen3_moe):
    folder, hf = qwen3_moe
    path = str(tmp_path / "qwen3moe.gguf")
    write_qwen3moe_gguf(path, hf.config, hf.state_dict())

    config = load_hf_config(path)
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert config.model_type == "qwen3_moe"
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "tie_word_embeddings",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",  # [1]: the layer without a router
    ):
        assert getattr(config, field) == getattr(hf.config, field), field

    # The checkpoint's per-expert names and weights.
    weights = dict(iter_weights(path, torch.float32))
    experts = {f"model.layers.{i}.mlp.experts.{e}" for i in (0, 2) for e in range(8)}
    assert {n.rsplit(".", 2)[0] for n in weights if ".experts." in n} == experts
    gate_up, down = (
        hf.model.layers[2].mlp.experts.gate_up_proj,
        hf.model.layers[2].mlp.experts.down_proj,
    )
    assert torch.equal(weights["model.layers.2.mlp.experts.5.gate_proj.weight"], gate_up[5, :32])
    assert torch.equal(weights["model.layers.2.mlp.experts.5.up_proj.weight"], gate_up[5, 32:])
    assert torch.equal(weights["model.layers.2.mlp.experts.5.down_proj.weight"], down[5])
    assert torch.equal(
        weights["model.layers.2.mlp.gate.weight"], hf.model.layers[2].mlp.gate.weight
    )

    assert_greedy_equals_hf(path, folder, hf, quantization="none")


@pytest.mark.skipif(gguf_kernels.load_gguf_kernels() is None, reason="no C compiler")
def test_quantized_experts_keep_their_blocks_and_give_hf_greedy_outputs(
    tmp_path, qwen3_moe, monkeypatch
):
    """Each expert's rows of a quantized stacked tensor are its own GGUF weight; with the
    float32 kernel the outputs are HF's on the file's (dequantized) weights."""
    from transformers import Qwen3MoeForCausalLM

    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")
    folder, hf = qwen3_moe
    path = str(tmp_path / "qwen3moe-q.gguf")
    qtypes = {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0"}
    held = write_qwen3moe_gguf(path, hf.config, hf.state_dict(), qtypes)
    hf_q = Qwen3MoeForCausalLM(hf.config).eval()
    hf_q.load_state_dict(held)

    config = load_hf_config(path)
    backend = get_platform("cpu").create_attn_backend(16)
    model = resolve_model_class(config)(config, backend, quant_config=GGUFConfig())
    model.load_weights(iter_weights(path, torch.float32, "gguf"))
    expert = model.model.layers[2].mlp.experts[5]
    gate_up, down = expert.gate_up_proj.weight, expert.down_proj.weight
    assert gate_up.numel() == down.numel() == 0  # no float copy
    assert [(row, t.qtype, t.shape) for row, t in gate_up.quantized.segments] == [
        (0, Q8_0, (32, 64)),
        (32, Q4_0, (32, 64)),
    ]
    assert [(row, t.qtype, t.shape) for row, t in down.quantized.segments] == [(0, Q8_0, (64, 32))]
    # Expert 5's own rows of the stacked tensor.
    torch.testing.assert_close(
        down.quantized.segments[0][1].dequantize(), held["model.layers.2.mlp.experts.down_proj"][5]
    )

    assert_greedy_equals_hf(path, folder, hf_q, quantization="gguf")
    # The reference is not the original model: the quantization changes its outputs.
    ids = torch.tensor([[1, 5, 9, 42, 7, 100]])
    with torch.no_grad():
        assert not torch.allclose(hf(ids).logits, hf_q(ids).logits, atol=1e-3)


@pytest.mark.skipif(gguf_kernels.load_gguf_kernels() is None, reason="no C compiler")
def model_with_kept_blocks(path: str):
    """The model of a GGUF file as the engine builds it with quantization "gguf": its
    weights loaded and packed for the kernels."""
    from minivllm.model.weight_loading import process_weights_after_loading

    config = load_hf_config(path)
    backend = get_platform("cpu").create_attn_backend(16)
    model = resolve_model_class(config)(config, backend, quant_config=GGUFConfig())
    model.load_weights(iter_weights(path, torch.float32, "gguf"))
    process_weights_after_loading(model)
    return model


def assert_one_call_is_one_by_one(moe, scale: float = 1.0, atol: float = 1e-6) -> None:
    """A layer's packed experts in one kernel call give the outputs of running them expert
    by expert (each a packed product), on 9 random tokens times scale."""
    hidden, experts = moe[0].gate_up_proj.input_size, len(moe)
    assert moe.packed is not None and moe.packed.num_experts == experts
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(0)) * scale
    logits = torch.randn(9, experts, generator=torch.Generator().manual_seed(1))
    one_call = moe(x, logits)
    packed, moe.packed = moe.packed, None
    try:
        torch.testing.assert_close(one_call, moe(x, logits), rtol=1e-5, atol=atol)
    finally:
        moe.packed = packed
    assert one_call.abs().max() > 1e4 * atol  # the comparison is not one of near-zeros


def test_packed_experts_run_in_one_kernel_call_as_one_by_one(tmp_path, qwen3_moe):
    """With the int8 kernels, each layer's packed experts run in one call
    (gguf_kernels.moe_forward), with the outputs of running them expert by expert."""
    folder, hf = qwen3_moe
    path = str(tmp_path / "qwen3moe-q.gguf")
    qtypes = {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0"}
    write_qwen3moe_gguf(path, hf.config, hf.state_dict(), qtypes)
    model = model_with_kept_blocks(path)
    assert_one_call_is_one_by_one(model.model.layers[2].mlp.experts)


@pytest.mark.skipif(gguf_kernels.load_gguf_kernels() is None, reason="no C compiler")
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "olmoe"])
def test_decode_steps_of_packed_experts_replay_as_cpu_graphs(
    monkeypatch, tmp_path, smollm2_tokenizer, qwen3_moe, arch
):
    """The one kernel call routes the tokens itself: every decode step is a CPU graph (the
    routing is replayed, not frozen at the capture), with the eager steps' tokens; Qwen2-MoE's
    gated shared expert and OLMoE's q/k norms over the projection too."""
    import transformers

    if arch == "qwen3moe":
        folder, hf = qwen3_moe
    else:
        checkpoint, cls = {
            "qwen2moe": ("qwen2-moe", transformers.Qwen2MoeForCausalLM),
            "olmoe": ("olmoe", transformers.OlmoeForCausalLM),
        }[arch]
        folder = write_tiny_checkpoint(checkpoint, str(tmp_path / "hf"), smollm2_tokenizer)
        hf = cls.from_pretrained(folder, dtype=torch.float32).eval()
    path = str(tmp_path / f"{arch}-q.gguf")
    write_qwen3moe_gguf(path, hf.config, hf.state_dict(), {"exps": "Q8_0"}, arch=arch)
    replayed, graphs = run(monkeypatch, "1", "gguf", path, tokenizer=folder)
    eager, _ = run(monkeypatch, "0", "gguf", path, tokenizer=folder)
    assert replayed == eager
    assert sorted(size for size, graph in graphs.items() if graph is not None) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-expert"])
def test_mixtral_gguf_config_and_greedy_outputs(tmp_path, smollm2_tokenizer, stacked):
    """A llama file with experts is Mixtral's, its experts stacked or (early files) one
    tensor each; its q/k rows come back in HF's order."""
    from transformers import MixtralForCausalLM

    folder = write_tiny_checkpoint("mixtral", str(tmp_path / "hf"), smollm2_tokenizer)
    # A GGUF file holds no window: llama.cpp attends over the whole context.
    hf = MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32, sliding_window=None)
    hf = hf.eval()
    path = str(tmp_path / "mixtral.gguf")
    write_qwen3moe_gguf(path, hf.config, hf.state_dict(), arch="llama", stacked=stacked)
    if not stacked:
        assert "blk.0.ffn_up.3.weight" in read_gguf_header(path).tensor_shapes

    config = load_hf_config(path)
    assert config.architectures == ["MixtralForCausalLM"]
    assert config.model_type == "mixtral"
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rope_parameters",
        "num_local_experts",
        "num_experts_per_tok",
        "sliding_window",
    ):
        assert getattr(config, field) == getattr(hf.config, field), field

    assert_greedy_equals_hf(path, folder, hf, quantization="none")


def test_granitemoe_gguf_config_and_greedy_outputs(tmp_path, smollm2_tokenizer, monkeypatch):
    """Granite MoE: Granite's four scales, llama's layout, experts feed_forward_length wide,
    the chosen scores renormalised; in float32, and with the experts kept in Q8_0."""
    from transformers import GraniteMoeForCausalLM

    folder = write_tiny_checkpoint("granite-moe", str(tmp_path / "hf"), smollm2_tokenizer)
    hf = GraniteMoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = str(tmp_path / "granitemoe.gguf")
    write_qwen3moe_gguf(path, hf.config, hf.state_dict(), arch="granitemoe")

    config = load_hf_config(path)
    assert config.architectures == ["GraniteMoeForCausalLM"]
    for field in (
        "intermediate_size", "num_local_experts", "num_experts_per_tok", "embedding_multiplier",
        "residual_multiplier", "attention_multiplier", "logits_scaling",
    ):  # fmt: skip
        assert getattr(config, field) == getattr(hf.config, field), field
    assert_greedy_equals_hf(path, folder, hf, quantization="none")

    quantized = str(tmp_path / "granitemoe-q8_0.gguf")
    held = write_qwen3moe_gguf(
        quantized, hf.config, hf.state_dict(), {"_exps": "Q8_0"}, arch="granitemoe"
    )
    assert_f32_kernel_greedy_equals_hf(
        quantized, folder, GraniteMoeForCausalLM, hf.config, held, monkeypatch
    )


def test_olmoe_gguf_config_and_greedy_outputs(tmp_path, smollm2_tokenizer):
    """OLMoE: q/k norms over the whole projection (attn_q_norm [hidden]), every layer
    sparse, experts feed_forward_length wide, the scores not renormalised."""
    from transformers import OlmoeForCausalLM

    folder = write_tiny_checkpoint("olmoe", str(tmp_path / "hf"), smollm2_tokenizer)
    hf = OlmoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = str(tmp_path / "olmoe.gguf")
    write_qwen3moe_gguf(path, hf.config, hf.state_dict(), arch="olmoe")
    assert read_gguf_header(path).tensor_shapes["blk.0.attn_q_norm.weight"] == (64,)

    config = load_hf_config(path)
    assert config.architectures == ["OlmoeForCausalLM"]
    assert config.model_type == "olmoe"
    for field in ("intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob"):
        assert getattr(config, field) == getattr(hf.config, field), field
    assert config.mlp_only_layers == []

    assert_greedy_equals_hf(path, folder, hf, quantization="none")


def test_qwen2moe_gguf_config_and_greedy_outputs(tmp_path, smollm2_tokenizer):
    """Qwen2-MoE: q/k/v biases, a gated shared expert (its gate a vector in the file), the
    chosen scores not renormalised (llama.cpp's qwen2moe and HF's config alike)."""
    from transformers import Qwen2MoeForCausalLM

    folder = write_tiny_checkpoint("qwen2-moe", str(tmp_path / "hf"), smollm2_tokenizer)
    hf = Qwen2MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = str(tmp_path / "qwen2moe.gguf")
    write_qwen3moe_gguf(path, hf.config, hf.state_dict(), arch="qwen2moe")
    assert read_gguf_header(path).tensor_shapes["blk.0.ffn_gate_inp_shexp.weight"] == (64,)

    config = load_hf_config(path)
    assert config.architectures == ["Qwen2MoeForCausalLM"]
    assert config.model_type == "qwen2_moe"
    for field in (
        "intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "mlp_only_layers",
    ):
        assert getattr(config, field) == getattr(hf.config, field), field
    weights = dict(iter_weights(path, torch.float32))
    gate = hf.model.layers[2].mlp.shared_expert_gate.weight
    assert torch.equal(weights["model.layers.2.mlp.shared_expert_gate.weight"], gate)

    assert_greedy_equals_hf(path, folder, hf, quantization="none")
