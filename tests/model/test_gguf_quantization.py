"""quantization="gguf": layers keep GGUF blocks, shard them at block boundaries, and the
float32-dequantizing kernel path gives the float32-dequantized model's greedy outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minivllm.distributed.parallel_state import TPGroup
from minivllm.kernels import gguf_kernels as gk
from minivllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.layers.linear import (
    Linear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.model.layers.quantization.base import weight_bytes
from minivllm.model.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod, GGUFTensor
from minivllm.model.loader import default_model_path, iter_weights, load_hf_config, read_gguf_header
from minivllm.model.registry import resolve_model_class
from minivllm.platforms import get_platform
from tests.kernels.test_gguf_kernels import random_blocks

pytestmark = pytest.mark.skipif(gk.load_gguf_kernels() is None, reason="no C compiler")


def gguf_tensor(name: str, rows: int, k: int, seed: int = 0) -> tuple[GGUFTensor, torch.Tensor]:
    raw = torch.from_numpy(random_blocks(name, rows, k, seed))
    qtype = gk.SUPPORTED_TYPES[name]
    return GGUFTensor(raw, qtype, (rows, k)), gk.dequantize(raw, qtype, k)


def test_fused_shards_of_different_types_and_tensor_parallel_rows(monkeypatch):
    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")
    gate, gate_f = gguf_tensor("Q4_K", 64, 256, seed=1)
    up, up_f = gguf_tensor("Q6_K", 64, 256, seed=2)
    x = torch.randn(3, 256)
    outs = []
    for rank in range(2):
        layer = MergedColumnParallelLinear(
            256, {0: 64, 1: 64}, tp=TPGroup(rank=rank, size=2), quant_config=GGUFConfig()
        )
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        assert layer.weight.numel() == 0  # no float copy kept
        layer.quant_method.process_weights_after_loading(layer)
        assert isinstance(layer.quant_method, GGUFLinearMethod)
        outs.append(layer(x).chunk(2, dim=-1))
    got_gate = torch.cat([o[0] for o in outs], -1)
    got_up = torch.cat([o[1] for o in outs], -1)
    torch.testing.assert_close(got_gate, x @ gate_f.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_up, x @ up_f.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["int8", "f32"])
@pytest.mark.parametrize("blocks_first", [True, False])
def test_fused_shards_held_dense_beside_blocks(monkeypatch, kernel, blocks_first):
    """A file may hold q in blocks and k/v dense (F16, or an IQ type read dense): in either
    loading order the layer keeps the blocks and multiplies the dense rows beside them."""
    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", kernel)
    q, q_f = gguf_tensor("Q8_0", 64, 64, seed=6)
    k, v = torch.randn(32, 64), torch.randn(32, 64)
    shards = [("q", q), ("k", k), ("v", v)] if blocks_first else [("k", k), ("v", v), ("q", q)]
    layer = QKVParallelLinear(64, 16, 4, 2, bias=False, quant_config=GGUFConfig())
    for shard_id, tensor in shards:
        layer.weight.weight_loader(layer.weight, tensor, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method, GGUFLinearMethod)
    assert [row for row, _ in layer.weight.quantized.dense] == [64, 96]
    x = torch.randn(3, 64)
    y = layer(x)
    torch.testing.assert_close(y[:, 64:], x @ torch.cat([k, v]).T, rtol=1e-5, atol=1e-4)
    tolerance = 1e-4 if kernel == "f32" else 0.02 * (x @ q_f.T).abs().max().item()
    torch.testing.assert_close(y[:, :64], x @ q_f.T, rtol=0, atol=tolerance)


def test_a_kernel_refusal_is_raised_not_left_in_the_output():
    """The layer's hot path calls the C kernel with its arguments ready (no checks of its
    own); a call the kernel refuses raises instead of returning an unwritten output."""
    layer = Linear(64, 16, quant_config=GGUFConfig())
    weight, weight_f = gguf_tensor("Q8_0", 16, 64, seed=7)
    layer.weight.weight_loader(layer.weight, weight)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.ones(1, 64)
    ref = x @ weight_f.T
    assert ((layer(x) - ref).abs().max() / ref.abs().max()) < 0.02
    gguf_weight = layer.weight.quantized
    ((_, ptr, rows, offset),) = gguf_weight.packed_calls
    gguf_weight.packed_calls = [(1, ptr, rows, offset)]  # F16: no packed layout
    with pytest.raises(RuntimeError, match="refused"):
        layer(x)


def test_row_parallel_splits_at_blocks_or_says_why(monkeypatch):
    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")
    down, down_f = gguf_tensor("Q4_0", 16, 128, seed=3)
    x = torch.randn(2, 128)
    partial = []
    for rank in range(2):
        layer = RowParallelLinear(128, 16, tp=TPGroup(rank=rank, size=2), quant_config=GGUFConfig())
        layer.weight.weight_loader(layer.weight, down)
        part = x[:, rank * 64 : (rank + 1) * 64]
        partial.append(layer.quant_method.apply(layer, part))  # before the all-reduce
    torch.testing.assert_close(sum(partial), x @ down_f.T, rtol=1e-4, atol=1e-4)
    k_quant, _ = gguf_tensor("Q4_K", 16, 256, seed=4)
    layer = RowParallelLinear(256, 16, tp=TPGroup(rank=1, size=2), quant_config=GGUFConfig())
    with pytest.raises(ValueError, match="256-value blocks"):
        layer.weight.weight_loader(layer.weight, k_quant)


def test_embedding_gathers_rows_and_a_tied_head_runs_quantized():
    table, table_f = gguf_tensor("Q8_0", 10, 64, seed=5)
    for size in (1, 3):  # 3 ranks: 4 rows each, the last rank padded with zero blocks
        embeds, heads = [], []
        for rank in range(size):
            tp = TPGroup(rank=rank, size=size)
            emb = VocabParallelEmbedding(10, 64, tp)
            emb.weight.weight_loader(emb.weight, table)
            head = ParallelLMHead(10, 64, tp, tied_to=emb, quant_config=GGUFConfig())
            head.quant_method.process_weights_after_loading(head)
            ids = torch.tensor([[0, 9, 4]])
            local = ids - emb.vocab_start
            inside = (local >= 0) & (local < emb.rows_per_rank)
            embeds.append(emb.lookup(local.clamp(0, emb.rows_per_rank - 1)) * inside[..., None])
            heads.append(head.quant_method.apply(head, torch.ones(1, 64)))
        assert torch.equal(sum(embeds), table_f[ids])
        logits = torch.cat(heads, -1)[:, :10]
        ref = F.linear(torch.ones(1, 64), table_f)
        assert ((logits - ref).abs().max() / ref.abs().max()) < 0.02  # int8 activations


def file_tensor_bytes(path: str) -> int:
    """Bytes of every tensor of a GGUF file, in its own types."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    header = read_gguf_header(path)
    total = 0
    for name, shape in header.tensor_shapes.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(header.tensor_data[name][0])]
        total += int(np.prod(shape)) // block * size
    return total


def test_quantization_is_inferred_for_gguf_files_where_the_kernels_run():
    from minivllm.engine.create_config import resolve_quantization
    from minivllm.platforms import get_platform

    cpu, cuda = get_platform("cpu"), get_platform("cuda")
    assert resolve_quantization(None, "m.gguf", cpu) == "gguf"  # vLLM's "infer it"
    assert resolve_quantization("gguf", "m.gguf", cpu) == "gguf"
    assert resolve_quantization("none", "m.gguf", cpu) is None  # dequantize at load
    assert resolve_quantization(None, "/models/llama", cpu) is None  # an HF folder
    assert resolve_quantization(None, "m.gguf", cpu, "bfloat16") is None  # kernels: float32
    assert resolve_quantization(None, "m.gguf", cuda) is None
    with pytest.raises(ValueError, match="needs a .gguf model"):
        resolve_quantization("gguf", "/models/llama", cpu)
    # An MXFP4 checkpoint (gpt-oss as released): its blocks are kept as a GGUF file's.
    assert resolve_quantization(None, "/models/gpt-oss", cpu, mxfp4=True) == "gguf"
    assert resolve_quantization("mxfp4", "/models/gpt-oss", cpu, mxfp4=True) == "gguf"
    assert resolve_quantization("none", "/models/gpt-oss", cpu, mxfp4=True) is None
    assert resolve_quantization(None, "/models/gpt-oss", cuda, mxfp4=True) is None
    with pytest.raises(ValueError, match="needs an MXFP4 checkpoint"):
        resolve_quantization("mxfp4", "/models/llama", cpu)
    for platform, dtype in ((cuda, "float32"), (cpu, "bfloat16")):
        with pytest.raises(ValueError, match="runs on the CPU in float32"):
            resolve_quantization("gguf", "m.gguf", platform, dtype)


def test_engine_reports_weight_memory_and_quantization(caplog):
    """The engine says whether the bundled GGUF keeps its blocks, with the weights' bytes
    (through the core process's handshake), and so does the start-up log."""
    from minivllm import LLM

    file_bytes = file_tensor_bytes(default_model_path())
    llm = LLM(max_model_len=256, enable_multiprocessing=True, quantization="gguf")
    try:
        engine = llm.llm_engine
        assert engine.quantization == "gguf"
        assert file_bytes <= engine.weight_memory_bytes <= 1.15 * file_bytes
    finally:
        engine.shutdown()
    with caplog.at_level("INFO", logger="minivllm.worker.worker"):
        dense = LLM(max_model_len=256, enable_multiprocessing=False, quantization="none")
    assert dense.llm_engine.quantization == "none"
    assert dense.llm_engine.weight_memory_bytes > 8 * file_bytes  # float32: oneDNN's + panels
    mib = dense.llm_engine.weight_memory_bytes / (1 << 20)
    assert f"Model weights: {mib:.1f} MiB (quantization=none)." in caplog.messages


def test_bundled_model_keeps_its_blocks():
    path = default_model_path()
    config = load_hf_config(path)
    from minivllm.platforms import get_platform

    backend = get_platform("cpu").create_attn_backend(16)
    model = resolve_model_class(config)(config, backend, quant_config=GGUFConfig())
    model.load_weights(iter_weights(path, torch.float32, "gguf"))
    file_bytes = file_tensor_bytes(path)
    assert weight_bytes(model) <= 1.15 * file_bytes
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, quantized once
    from minivllm.model.weight_loading import process_weights_after_loading

    process_weights_after_loading(model)  # repacked for the int8 kernels: same size
    assert weight_bytes(model) <= 1.15 * file_bytes
    head = model.lm_head.weight.quantized
    assert [t.packed for _, t in head.segments] == [True]


@pytest.mark.slow
def test_float32_kernel_path_gives_the_dequantized_models_greedy_outputs(monkeypatch):
    from minivllm import LLM, SamplingParams

    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=24)
    outputs = {}
    for quantization in ("none", "gguf"):
        llm = LLM(
            quantization=quantization,
            enable_multiprocessing=False,
            max_model_len=512,
            kv_cache_memory_bytes=1 << 26,
        )
        outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    assert outputs["gguf"] == outputs["none"]


# Every IQ1-IQ3 type, each on its own matrices: q, k, v three types in one fused layer.
GRID_TYPES = {
    "attn_q": "IQ2_XXS", "attn_k": "IQ2_XS", "attn_v": "IQ2_S", "attn_output": "IQ3_XXS",
    "ffn_gate": "IQ3_S", "ffn_up": "IQ1_S", "ffn_down": "IQ1_M", "token_embd": "IQ3_S",
    "output.": "IQ2_XXS",
}  # fmt: skip


# q and up in blocks, k, v and gate F32 (as an IQ3_XXS file's fused layers mix a type the
# kernels take with one read dense); every matrix in IQ4_NL (levels, not a linear grid);
# every matrix in a grid type (256-weight blocks: a model of 256 hidden units).
@pytest.mark.parametrize(
    "qtypes",
    [
        {"attn_q": "Q8_0", "ffn_up": "Q4_0"},
        {name: "IQ4_NL" for name in ("attn", "ffn", "token_embd", "output.")},
        GRID_TYPES,
    ],
    ids=["dense-beside-blocks", "iq4_nl", "iq1-iq3"],
)
def test_quantized_gguf_gives_hf_greedy_outputs_and_replays(
    tmp_path, smollm2_tokenizer, monkeypatch, qtypes
):
    """The float32 kernel path gives HF's greedy tokens on the file's weights, and with the
    int8 kernels every decode size replays as a CPU graph with the eager steps' tokens."""
    from transformers import LlamaForCausalLM

    from tests.conftest import write_tiny_checkpoint
    from tests.model.test_gguf_phi3 import assert_greedy_equals_hf
    from tests.model.test_loader import _write_gguf
    from tests.worker.test_cpu_graph import run

    sizes = {"hidden_size": 256, "intermediate_size": 512} if qtypes is GRID_TYPES else {}
    folder = write_tiny_checkpoint("llama", str(tmp_path / "hf"), smollm2_tokenizer, **sizes)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = str(tmp_path / "quantized.gguf")
    held = _write_gguf(path, "llama", hf.config, hf.state_dict(), qtypes)
    hf_q = LlamaForCausalLM(hf.config).eval()
    hf_q.load_state_dict(held)

    # The blocks stay blocks, in the file's types; the F32 shards are dense rows beside them.
    config = load_hf_config(path)
    backend = get_platform("cpu").create_attn_backend(16)
    model = resolve_model_class(config)(config, backend, quant_config=GGUFConfig())
    model.load_weights(iter_weights(path, torch.float32, "gguf"))
    layer = model.model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        segments = [(row, t.qtype) for row, t in module.weight.quantized.segments]
        dense = [row for row, _ in module.weight.quantized.dense]
        if qtypes.get("attn_q") == "Q8_0":
            assert segments in (
                [(0, gk.SUPPORTED_TYPES["Q8_0"])],
                [(128, gk.SUPPORTED_TYPES["Q4_0"])],
            )
            assert dense in ([64, 96], [0])
        elif qtypes is GRID_TYPES:  # a segment per shard, each in its own type
            parts = ["attn_q", "attn_k", "attn_v"] if module is layer.self_attn.qkv_proj else [
                "ffn_gate", "ffn_up"]  # fmt: skip
            assert [qtype for _, qtype in segments] == [
                gk.SUPPORTED_TYPES[qtypes[part]] for part in parts
            ]
            assert not dense
        else:
            assert {qtype for _, qtype in segments} == {gk.SUPPORTED_TYPES["IQ4_NL"]}
            assert not dense

    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")
    assert_greedy_equals_hf(path, folder, hf_q, quantization="gguf")

    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "int8")
    replayed, graphs = run(monkeypatch, "1", "gguf", path, tokenizer=folder)
    eager, _ = run(monkeypatch, "0", "gguf", path, tokenizer=folder)
    assert replayed == eager
    assert sorted(size for size, graph in graphs.items() if graph is not None) == [1, 2, 3, 4, 5, 6]
