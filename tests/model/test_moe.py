"""Qwen3-MoE and Mixtral beyond HF parity (test_hf_parity_archs.py): the experts layer
against a plain reference, with its tensor-parallel shards and its graph-safe path;
checkpoints holding the experts fused as 3D tensors; decode steps with CPU graphs on,
which cannot replay the data-dependent routing and must run eagerly."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from minivllm.distributed.parallel_state import TPGroup
from minivllm.kernels.cpu_kernels import load_kernels
from minivllm.model.layers.fused_moe import FusedMoE
from tests.conftest import write_tiny_checkpoint
from tests.worker.test_cpu_graph import run

E, K, HIDDEN, INTER = 8, 3, 16, 32


def reference_moe(x, logits, gate_up, down, renormalize: bool) -> torch.Tensor:
    """Token by token, choice by choice: the definition."""
    probs = torch.softmax(logits.float(), dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        weights, ids = torch.topk(probs[t], K)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist(), strict=True):
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, down[e])
    return out


def build(tp: TPGroup, gate_up, down, renormalize: bool) -> FusedMoE:
    moe = FusedMoE(E, K, HIDDEN, INTER, renormalize, tp)
    for e, expert in enumerate(moe):
        w = expert.gate_up_proj.weight
        w.weight_loader(w, gate_up[e, :INTER], 0)
        w.weight_loader(w, gate_up[e, INTER:], 1)
        expert.down_proj.weight.weight_loader(expert.down_proj.weight, down[e])
    return moe


@pytest.mark.parametrize("renormalize", [True, False])
def test_experts_sum_the_chosen_outputs_on_every_rank_split(renormalize):
    torch.manual_seed(0)
    gate_up, down = torch.randn(E, 2 * INTER, HIDDEN), torch.randn(E, HIDDEN, INTER)
    x, logits = torch.randn(7, HIDDEN), torch.randn(7, E) * 3
    expected = reference_moe(x, logits, gate_up, down, renormalize)

    moe = build(TPGroup(), gate_up, down, renormalize)
    torch.testing.assert_close(moe(x, logits), expected, rtol=1e-5, atol=1e-4)
    # No tokens: nothing routed, nothing run.
    assert moe(x[:0], logits[:0]).shape == (0, HIDDEN)

    # Two ranks, each with half of every expert's intermediate features: the partial sums
    # add up to the whole (the all-reduce, done by hand).
    parts = [
        build(TPGroup(rank=r, size=2), gate_up, down, renormalize).partial_sum(x, logits)
        for r in range(2)
    ]
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-4)


def test_a_split_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        FusedMoE(E, K, HIDDEN, INTER, True, TPGroup(rank=0, size=3))


def test_olmoe_refuses_a_tensor_parallel_split():
    """OLMoE's q/k norms span all heads: a rank holding some of them cannot normalise."""
    from transformers import OlmoeConfig

    from minivllm.model.models.olmoe import OlmoeForCausalLM
    from minivllm.platforms import get_platform

    config = OlmoeConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1)
    backend = get_platform("cpu").create_attn_backend(16)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        OlmoeForCausalLM(config, backend, TPGroup(rank=0, size=2))


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return write_tiny_checkpoint("qwen3-moe", str(folder), smollm2_tokenizer)


@pytest.mark.skipif(load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None, reason="no C compiler")
def test_decode_steps_run_eagerly_with_cpu_graphs_on(monkeypatch, moe_folder):
    replayed, graphs = run(monkeypatch, "1", "none", moe_folder)
    eager, _ = run(monkeypatch, "0", "none", moe_folder)
    assert replayed == eager
    # Every size was tried once and dropped: the routing is not a replayable kernel call.
    assert graphs and all(graph is None for graph in graphs.values())


def test_no_cuda_graphs_are_captured(monkeypatch, moe_folder):
    """The experts are picked on the host, which a CUDA graph cannot replay: a platform
    with CUDA graphs leaves MoE models eager (capturing here, on the CPU, would fail)."""
    from minivllm import LLM
    from minivllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "supports_cuda_graphs", True)
    llm = LLM(moe_folder, max_model_len=64, enable_multiprocessing=False)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert runner.cuda_graphs is None


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_experts_fused_as_3d_tensors_load(monkeypatch, tmp_path, smollm2_tokenizer, arch):
    """transformers 5's in-memory layout: mlp.experts.gate_up_proj [E, 2I, H] (gate rows,
    then up rows) and mlp.experts.down_proj [E, H, I]; on disk, Qwen3-MoE's checkpoints
    name mlp.experts.{e}.gate_proj ..., Mixtral's block_sparse_moe.experts.{e}.w1 ..."""
    import transformers
    from safetensors.torch import safe_open, save_file

    moe_folder = write_tiny_checkpoint(arch, str(tmp_path / arch), smollm2_tokenizer)
    with safe_open(os.path.join(moe_folder, "model.safetensors"), "pt") as f:
        per_expert = "mlp.experts.0.gate_proj" if arch == "qwen3-moe" else "experts.0.w1"
        assert any(per_expert in name for name in f.keys())

    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32)
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(state, str(fused / "model.safetensors"))
    for name in os.listdir(moe_folder):
        if not name.endswith(".safetensors"):
            os.link(os.path.join(moe_folder, name), fused / name)
    with open(fused / "config.json") as f:
        assert json.load(f)["architectures"] == [type(hf).__name__]
    expected, _ = run(monkeypatch, "0", "none", moe_folder)
    tokens, _ = run(monkeypatch, "0", "none", str(fused))
    assert tokens == expected


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-moe", "gpt-oss"])
def test_two_ranks_give_hf_greedy_outputs(tmp_path, smollm2_tokenizer, arch):
    """Two worker processes, each with half of every expert (and of Qwen2-MoE's shared
    one; gpt-oss: half of the heads with their sinks, the experts' down biases on rank 0):
    the all-reduce of the experts' partial sums, and the dense layer's, give HF's tokens."""
    from tests.model.test_hf_parity_archs import assert_two_ranks_give_hf_greedy_outputs

    folder = write_tiny_checkpoint(arch, str(tmp_path / arch), smollm2_tokenizer)
    assert_two_ranks_give_hf_greedy_outputs(folder)
