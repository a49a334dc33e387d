"""gpt-oss beyond HF parity on its checkpoint (test_hf_parity_archs.py): its biased experts
with their activation against HF's, on every tensor-parallel split; checkpoints with the
experts in MXFP4 as released; llama.cpp's GGUF layout, with MXFP4 experts as its files."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from minivllm.distributed.parallel_state import TPGroup
from minivllm.kernels import gguf_kernels
from minivllm.model.layers.activation import SwigluOAIAndMul
from minivllm.model.layers.fused_moe import FusedMoE
from minivllm.model.layers.quantization.mxfp4 import dequantize_mxfp4
from minivllm.model.loader import iter_weights, load_hf_config
from minivllm.model.models.gpt_oss import per_expert_gpt_oss
from tests.conftest import write_tiny_checkpoint
from tests.model.test_gguf_phi3 import assert_greedy_equals_hf

E, K, HIDDEN, INTER = 4, 2, 64, 32


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, smollm2_tokenizer):
    from transformers import GptOssForCausalLM

    folder = write_tiny_checkpoint(
        "gpt-oss", str(tmp_path_factory.mktemp("gpt-oss")), smollm2_tokenizer
    )
    hf = GptOssForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return folder, hf


def hf_experts():
    """HF's router and experts with random weights and biases (gate/up values past the
    clamp limit, so that both clamps act)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K
    )
    torch.manual_seed(0)
    mlp = GptOssMLP(config).eval()
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    return mlp


def build(tp: TPGroup, mlp) -> FusedMoE:
    moe = FusedMoE(E, K, HIDDEN, INTER, True, tp, bias=True, act_fn=SwigluOAIAndMul())
    params = dict(moe.named_parameters())
    fused = {f"experts.{n}": p.detach() for n, p in mlp.experts.named_parameters()}
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    for name, tensor in per_expert_gpt_oss(fused.items()):
        _, e, proj, kind = name.split(".")
        target, shard = packed.get(proj, (proj, None))
        param = params[f"{e}.{target}.{kind}"]
        args = (tensor,) if shard is None else (tensor, shard)
        param.weight_loader(param, *args)
    return moe


def test_biased_experts_with_clamped_swiglu_equal_hf_on_every_rank_split():
    mlp = hf_experts()
    x = torch.randn(9, HIDDEN) * 2
    with torch.no_grad():
        expected, _ = mlp(x.unsqueeze(0))
        logits = mlp.router(x)[0]  # HF returns (logits, scores, indices)
    expected = expected[0]
    assert expected.abs().max() > 1  # the comparison is not one of near-zeros

    moe = build(TPGroup(), mlp)
    torch.testing.assert_close(moe(x, logits), expected, rtol=1e-5, atol=1e-4)
    # Two ranks with half of every expert's features each; the down bias is rank 0's.
    parts = [build(TPGroup(rank=r, size=2), mlp).partial_sum(x, logits) for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-4)


def random_mxfp4(rows: int, columns: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, columns / 32, 16] bytes and [E, rows, columns / 32] exponents near 2^0."""
    blocks = torch.randint(0, 256, (E, rows, columns // 32, 16), generator=generator)
    scales = torch.randint(122, 128, (E, rows, columns // 32), generator=generator)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_mxfp4_dequantizes_as_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4(2 * INTER, HIDDEN, torch.Generator().manual_seed(1))
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, H, 2I]
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), expected)


@pytest.mark.parametrize("declared", [False, True], ids=["dequantized", "kept"])
def test_released_mxfp4_experts_load_as_their_dequantized_weights(
    tmp_path, gpt_oss, declared, monkeypatch
):
    """The released checkpoints keep the experts' matrices as MXFP4 blocks and scales:
    greedy outputs equal HF's model holding the dequantized matrices. Where the config
    declares them (quantization_config mxfp4, as released), they stay quantized on the CPU
    (the GGUF kernels; compared through the float32 one: exact products)."""
    import json

    import safetensors.torch

    from minivllm import LLM

    folder, hf = gpt_oss
    state = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    reference = {name: t.clone() for name, t in hf.state_dict().items()}
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        for matrix, (rows, columns) in (
            ("gate_up_proj", (2 * INTER, HIDDEN)),
            ("down_proj", (HIDDEN, INTER)),
        ):
            blocks, scales = random_mxfp4(rows, columns, g)
            del state[f"{prefix}.{matrix}"]
            state[f"{prefix}.{matrix}_blocks"] = blocks
            state[f"{prefix}.{matrix}_scales"] = scales
            reference[f"{prefix}.{matrix}"] = dequantize_mxfp4(blocks, scales).transpose(1, 2)
    mxfp4 = tmp_path / "mxfp4"
    mxfp4.mkdir()
    for name in os.listdir(folder):
        if name not in ("model.safetensors", "config.json"):
            os.symlink(os.path.join(folder, name), mxfp4 / name)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    if declared:
        config["quantization_config"] = {"quant_method": "mxfp4"}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    safetensors.torch.save_file(state, str(mxfp4 / "model.safetensors"))
    hf_mxfp4 = type(hf)(hf.config).eval()
    hf_mxfp4.load_state_dict(reference)
    if declared:
        monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")
        args = dict(max_model_len=128, enable_multiprocessing=False)
        kept = LLM(str(mxfp4), **args).llm_engine
        assert kept.quantization == "gguf" and kept.model_config.dtype == "float32"
        dense = LLM(str(mxfp4), quantization="none", **args).llm_engine
        # The experts' matrices at 18 bytes a 32 weights (packed), not 128.
        assert kept.weight_memory_bytes < dense.weight_memory_bytes
        del kept, dense
    assert_greedy_equals_hf(str(mxfp4), folder, hf_mxfp4)


# HF name -> llama.cpp's, for gpt-oss.
_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.router": "ffn_gate_inp",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_gpt_oss_gguf(path: str, config, state: dict, experts_type: str | None) -> dict:
    """A gpt-oss GGUF laid out as llama.cpp's converter writes one: the fused experts split
    into gate, up and down stacks ([E, rows, columns], biases [E, rows]), the sinks as
    attn_sinks.weight; the expert matrices in experts_type ("MXFP4": as released files), or
    float32 for None. Returns
    HF's state dict of the weights the file holds (dequantized)."""
    import gguf

    writer = gguf.GGUFWriter(path, "gpt-oss")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(config.rope_parameters["factor"])
    writer.add_rope_scaling_orig_ctx_len(config.rope_parameters["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(config.rope_parameters["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(config.rope_parameters["beta_slow"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_sliding_window(config.sliding_window)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    held = {name: tensor.clone() for name, tensor in state.items()}
    qtype = gguf.GGMLQuantizationType[experts_type] if experts_type else None

    def add(gguf_name: str, tensor: torch.Tensor, quantize: bool = False) -> torch.Tensor:
        array = tensor.contiguous().numpy().astype(np.float32)
        if not quantize:
            writer.add_tensor(gguf_name, array)
            return tensor
        blocks = gguf.quants.quantize(array, qtype)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())

    for name, tensor in state.items():
        module, kind = name.rsplit(".", 1)
        if module in _TOP:
            add(f"{_TOP[module]}.{kind}", tensor)
            continue
        layer, rest = name.split(".")[2], name.split(".", 3)[3]
        blk = f"blk.{layer}"
        if rest == "self_attn.sinks":
            add(f"{blk}.attn_sinks.weight", tensor)
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I], gate/up columns interleaved
            rows = tensor.transpose(1, 2)
            gate = add(f"{blk}.ffn_gate_exps.weight", rows[:, 0::2], bool(qtype))
            up = add(f"{blk}.ffn_up_exps.weight", rows[:, 1::2], bool(qtype))
            held[name][:, :, 0::2], held[name][:, :, 1::2] = gate.mT, up.mT
        elif rest == "mlp.experts.gate_up_proj_bias":
            add(f"{blk}.ffn_gate_exps.bias", tensor[:, 0::2])
            add(f"{blk}.ffn_up_exps.bias", tensor[:, 1::2])
        elif rest == "mlp.experts.down_proj":  # [E, I, H]
            down = add(f"{blk}.ffn_down_exps.weight", tensor.transpose(1, 2), bool(qtype))
            held[name] = down.mT
        elif rest == "mlp.experts.down_proj_bias":
            add(f"{blk}.ffn_down_exps.bias", tensor)
        else:
            module, kind = rest.rsplit(".", 1)
            add(f"{blk}.{_TO_GGUF[module]}.{kind}", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


@pytest.mark.parametrize("mxfp4", [False, True], ids=["f32", "mxfp4"])
def test_gguf_config_weights_and_greedy_outputs(tmp_path, gpt_oss, mxfp4, monkeypatch):
    folder, hf = gpt_oss
    path = str(tmp_path / "gpt-oss.gguf")
    held = write_gpt_oss_gguf(path, hf.config, hf.state_dict(), "MXFP4" if mxfp4 else None)

    config = load_hf_config(path)
    assert config.architectures == ["GptOssForCausalLM"]
    assert config.model_type == "gpt_oss"
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
        "rope_parameters",  # YaRN, its ramp unrounded (truncate false)
        "tie_word_embeddings",
        "num_local_experts",
        "num_experts_per_tok",
        "sliding_window",
        "layer_types",  # windows on the even layers
        "attention_bias",
        "swiglu_alpha",
        "swiglu_limit",
    ):
        assert getattr(config, field) == getattr(hf.config, field), field

    weights = dict(iter_weights(path, torch.float32))
    layer = hf.model.layers[2]
    assert torch.equal(weights["model.layers.2.self_attn.sinks"], layer.self_attn.sinks)
    assert torch.equal(weights["model.layers.2.mlp.router.bias"], layer.mlp.router.bias)
    gate_up_bias = layer.mlp.experts.gate_up_proj_bias
    assert torch.equal(weights["model.layers.2.mlp.experts.3.up_proj.bias"], gate_up_bias[3, 1::2])
    down = held["model.layers.2.mlp.experts.down_proj"]
    assert torch.equal(weights["model.layers.2.mlp.experts.3.down_proj.weight"], down[3].T)

    if not mxfp4:
        assert_greedy_equals_hf(path, folder, hf, quantization="none")
        return
    # The MXFP4 experts stay quantized: through the float32 kernel (exact products of the
    # dequantized weights), HF's greedy tokens on those weights.
    quantized = dict(iter_weights(path, torch.float32, quantization="gguf"))
    expert = quantized["model.layers.1.mlp.experts.2.gate_proj.weight"]
    assert expert.qtype == gguf_kernels.SUPPORTED_TYPES["MXFP4"]
    hf_q = type(hf)(hf.config).eval()
    hf_q.load_state_dict(held)
    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")
    assert_greedy_equals_hf(path, folder, hf_q, quantization="gguf")


@pytest.mark.skipif(gguf_kernels.load_gguf_kernels() is None, reason="no C compiler")
def test_mxfp4_experts_run_in_one_kernel_call_as_one_by_one(tmp_path, gpt_oss):
    """With the int8 kernels, each layer's MXFP4 experts, biases and gating included, run in
    one call (gguf_kernels.moe_forward), with the outputs of running them one by one."""
    from tests.model.test_gguf_moe import assert_one_call_is_one_by_one, model_with_kept_blocks

    folder, hf = gpt_oss
    path = str(tmp_path / "gpt-oss.gguf")
    write_gpt_oss_gguf(path, hf.config, hf.state_dict(), "MXFP4")
    moe = model_with_kept_blocks(path).model.layers[1].mlp.experts
    assert moe.packed is not None and moe.packed.swiglu == (1.702, 7.0)
    assert_one_call_is_one_by_one(moe, scale=3.0, atol=1e-5)
