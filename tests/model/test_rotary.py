"""RoPE tables equal transformers' cos/sin bit for bit, for every supported scaling."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from minivllm.model.layers.rotary import RotaryEmbedding, max_positions, rope_parameters

MAX_POS = 64
HEAD_DIM = 16

ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 10000.0,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "rope_theta": 50000.0,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
        "rope_theta": 500000.0,
    },
}


def llama_config(rope: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(rope),
    )


def hf_generation_tables(hf: LlamaRotaryEmbedding, prompt_len: int, end: int):
    """cos/sin as HF's generate sees them: one prefill, then one position per step."""
    x = torch.zeros(1)
    cos, sin = hf(x, torch.arange(prompt_len)[None])
    cos_rows, sin_rows = [cos[0]], [sin[0]]
    for position in range(prompt_len, end):
        cos, sin = hf(x, torch.tensor([[position]]))
        cos_rows.append(cos[0])
        sin_rows.append(sin[0])
    return torch.cat(cos_rows), torch.cat(sin_rows)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_tables_equal_transformers(case):
    config = llama_config(ROPE_CASES[case])
    ours = RotaryEmbedding(HEAD_DIM, MAX_POS, rope_parameters(config), torch.float32)
    end = max_positions(config)
    assert ours.num_positions == end
    # Dynamic NTK changes its base past max_position_embeddings: generate beyond it.
    cos, sin = hf_generation_tables(LlamaRotaryEmbedding(config), MAX_POS // 2, end)
    assert torch.equal(ours.cos, cos)
    assert torch.equal(ours.sin, sin)


def test_scaled_context_lengths():
    lengths = {case: max_positions(llama_config(rope)) for case, rope in ROPE_CASES.items()}
    assert lengths == {
        "default": MAX_POS,
        "linear": 4 * MAX_POS,
        "dynamic": 2 * MAX_POS,
        "yarn": MAX_POS,  # 32 trained positions x 2
        "yarn-mscale": MAX_POS,
        "llama3": MAX_POS,  # llama3 configs name the stretched length already
    }


def test_legacy_rope_scaling_is_read():
    config = transformers.PretrainedConfig(
        rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5000.0
    )
    assert rope_parameters(config) == {
        "type": "linear",
        "factor": 2.0,
        "rope_type": "linear",
        "rope_theta": 5000.0,
    }


def test_unsupported_rope_type_is_refused():
    with pytest.raises(ValueError, match="axial"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, {"rope_type": "axial", "rope_theta": 1.0}, torch.float32)


@pytest.mark.parametrize("factor", [0.25, 1.0])
def test_proportional_tables_equal_gemma4s(factor):
    """Gemma 4's global layers: a quarter of each head's pairs turn (frequencies over the
    whole head), the rest stay; the table is as wide as the head."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    full = {"rope_type": "proportional", "partial_rotary_factor": factor, "rope_theta": 1e6}
    config = transformers.Gemma4TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        global_head_dim=32,
        num_hidden_layers=2,
        max_position_embeddings=MAX_POS,
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    params = rope_parameters(config, "full_attention")
    ours = RotaryEmbedding(32, MAX_POS, params, torch.float32)
    hf = Gemma4TextRotaryEmbedding(config)
    cos, sin = hf(torch.zeros(1), torch.arange(MAX_POS)[None], "full_attention")
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])
    turned = int(factor * 32 // 2)
    assert torch.all(ours.sin[:, turned:16] == 0) and torch.any(ours.sin[1, :turned] != 0)


@pytest.mark.parametrize("partial", [1.0, 0.25])
def test_the_c_kernel_turns_q_and_k_as_torch_does(partial):
    """On float32 CPU tensors one C call rotates q and k in place (rows strided views of a
    fused projection), bit for bit as the torch path, partial rotary (Qwen3.5's quarter of
    each head, Phi-4 mini's) included."""
    rope = RotaryEmbedding(
        HEAD_DIM, MAX_POS, {"rope_type": "default", "rope_theta": 1e4,
                            "partial_rotary_factor": partial}, torch.float32,
    )  # fmt: skip
    if rope.kernels is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, 7 * HEAD_DIM, generator=g)
    q, k = qkv[:, : 4 * HEAD_DIM].view(6, 4, HEAD_DIM), qkv[:, 4 * HEAD_DIM :].view(6, 3, -1)
    positions = torch.tensor([0, 3, 9, 10, 31, 63])
    kernels, rope.kernels = rope.kernels, None
    want_q, want_k = rope(positions, q.clone(), k.clone())
    rope.kernels = kernels
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == qkv.data_ptr()  # turned in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
