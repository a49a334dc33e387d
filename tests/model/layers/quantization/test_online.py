"""Online quantization (quantization="q8_0", "q4_0", ...): a float checkpoint's matrices are
quantized at load into the blocks gguf's reference quantizer makes, and then run as a GGUF
file's: the bundled model's float32 HF directory served q8_0 holds the weights and, without
q8_0's refined outlier blocks, gives the greedy outputs of the same weights written as a
Q8_0 GGUF file."""

from __future__ import annotations

import json
import os

import pytest
import torch

from minivllm.kernels import gguf_kernels as gk
from minivllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.layers.linear import Linear, QKVParallelLinear
from minivllm.model.layers.quantization import get_quantization_config
from minivllm.model.layers.quantization import online as online_quant
from minivllm.model.layers.quantization.base import UnquantizedLinearMethod
from minivllm.model.layers.quantization.gguf import GGUFConfig, GGUFTensor
from minivllm.model.layers.quantization.online import (
    ONLINE_TYPES,
    REFINED_MODES,
    OnlineQuantLinearMethod,
)
from minivllm.model.weight_loading import process_weights_after_loading

pytestmark = pytest.mark.skipif(gk.load_gguf_kernels() is None, reason="no C compiler")


def reference_blocks(weight: torch.Tensor, type_name: str) -> GGUFTensor:
    """What a GGUF file written with the gguf package holds for ``weight``."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(weight.numpy(), qtype)
    return GGUFTensor(torch.from_numpy(blocks.copy()), int(qtype), tuple(weight.shape))


@pytest.mark.parametrize("name", list(ONLINE_TYPES))
def test_a_fused_layer_quantizes_each_shard_as_a_gguf_file_holds_it(name):
    torch.manual_seed(0)
    shards = {"q": torch.randn(64, 64), "k": torch.randn(32, 64), "v": torch.randn(32, 64)}
    online = QKVParallelLinear(64, 16, 4, 2, bias=False, quant_config=get_quantization_config(name))
    from_file = QKVParallelLinear(64, 16, 4, 2, bias=False, quant_config=GGUFConfig())
    for shard_id, weight in shards.items():
        online.weight.weight_loader(online.weight, weight, shard_id)
        assert online.weight.numel() == 0  # no float copy: blocks from the first shard on
        blocks = reference_blocks(weight, ONLINE_TYPES[name])
        from_file.weight.weight_loader(from_file.weight, blocks, shard_id)
    got = [(o, t.qtype, t.raw) for o, t in online.weight.quantized.segments]
    want = [(o, t.qtype, t.raw) for o, t in from_file.weight.quantized.segments]
    assert [(o, q) for o, q, _ in got] == [(o, q) for o, q, _ in want]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(got, want, strict=True))
    process_weights_after_loading(online)
    process_weights_after_loading(from_file)
    x = torch.randn(3, 64)
    x[:, 37] = 40  # an outlier channel, as the residual stream carries
    ((_, packed),) = online.weight.quantized.segments
    plain = gk.matmul_packed(x, packed.raw, packed.qtype, 128, 64)
    assert torch.equal(from_file(x), plain)  # the same packed blocks
    # q8_0 refines each row's costliest block (a second int8 pass); the others run as the file
    refined = gk.matmul_packed(x, packed.raw, packed.qtype, 128, 64, refined=True)
    assert torch.equal(online(x), refined if name in REFINED_MODES else plain)
    assert not torch.equal(refined, plain)


def test_routers_and_widths_not_whole_blocks_stay_float():
    config = get_quantization_config("q8_0")
    assert config.get_quant_method(Linear(64, 8), "model.layers.0.mlp.gate") is None
    assert config.get_quant_method(Linear(64, 8), "model.layers.0.mlp.router") is None
    odd = Linear(48, 8, quant_config=config)  # 48 inputs: not whole 32-value blocks
    weight = torch.randn(8, 48)
    odd.weight.weight_loader(odd.weight, weight)
    process_weights_after_loading(odd)
    assert type(odd.quant_method) is UnquantizedLinearMethod
    x = torch.randn(2, 48)
    torch.testing.assert_close(odd(x), x @ weight.T)


def test_a_tied_lm_head_is_quantized_once_and_the_embedding_reads_its_blocks():
    config = get_quantization_config("q4_0")
    embedding = VocabParallelEmbedding(100, 64)
    head = ParallelLMHead(100, 64, tied_to=embedding, quant_config=config)
    assert isinstance(head.quant_method, OnlineQuantLinearMethod)
    assert head.quant_method.type_name == "Q8_0"  # the head finer than 4-bit matrices
    table = torch.randn(100, 64)
    embedding.weight.weight_loader(embedding.weight, table)
    for module in (embedding, head):
        process_weights_after_loading(module)
    assert embedding.weight.numel() == 0 and embedding.weight.quantized is not None
    expected = reference_blocks(table, "Q8_0").dequantize()
    ids = torch.tensor([3, 97, 3])
    torch.testing.assert_close(embedding(ids), expected[ids], rtol=0, atol=0)
    hidden = torch.randn(2, 64)
    scale = (hidden @ expected.T).abs().max().item()
    torch.testing.assert_close(head(hidden), hidden @ expected.T, rtol=0, atol=0.02 * scale)


def test_an_embedding_given_the_config_keeps_its_table_in_q8_0_blocks_from_the_load_on():
    table = torch.randn(100, 64)
    embedding = VocabParallelEmbedding(100, 64, quant_config=get_quantization_config("q4_0"))
    embedding.weight.weight_loader(embedding.weight, table)
    assert embedding.weight.numel() == 0  # never held float
    expected = reference_blocks(table, "Q8_0").dequantize()
    ids = torch.tensor([[0, 99], [42, 42]])
    torch.testing.assert_close(embedding(ids), expected[ids], rtol=0, atol=0)
    plain = VocabParallelEmbedding(100, 64, quant_config=GGUFConfig())  # a file's own format
    plain.weight.weight_loader(plain.weight, table)
    assert torch.equal(plain.weight, table)


# ------------------------------------------------- the bundled model, as a float checkpoint


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory, smollm2_path, smollm2_tokenizer):
    """The bundled model's weights in float32 as an HF directory, and the same weights as a
    Q8_0 GGUF file written with the gguf package (its norms F32, as llama.cpp's)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from minivllm.model.loader import iter_weights, load_hf_config
    from tests.model.test_loader import _write_gguf

    folder = tmp_path_factory.mktemp("smollm2-float32")
    source = load_hf_config(smollm2_path)
    fields = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    )  # fmt: skip
    config = LlamaConfig(**{f: getattr(source, f) for f in fields})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    with open(folder / "config.json") as f:
        assert json.load(f)["model_type"] == "llama"
    state = {n: t.clone().contiguous() for n, t in iter_weights(smollm2_path, torch.float32)}
    save_file(state, str(folder / "model.safetensors"))
    smollm2_tokenizer.save_pretrained(folder)
    q8_file = str(tmp_path_factory.mktemp("q8") / "smollm2-Q8_0.gguf")
    _write_gguf(q8_file, "llama", config, state, qtypes={"": "Q8_0"})
    return str(folder), q8_file


def greedy(llm) -> list[list[int]]:
    from minivllm import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def test_a_float_checkpoint_served_q8_0_is_the_q8_0_gguf_of_its_weights(
    float_checkpoint, monkeypatch
):
    from minivllm import LLM
    from tests.model.test_gguf_quantization import file_tensor_bytes

    # the file's product, without q8_0's refined blocks (the fused layer's test checks them)
    monkeypatch.setattr(online_quant, "REFINED_MODES", ())
    folder, q8_file = float_checkpoint
    online = LLM(folder, quantization="q8_0", max_model_len=256, enable_multiprocessing=False)
    engine = online.llm_engine
    assert engine.quantization == "q8_0"
    online_bytes = engine.weight_memory_bytes
    online_outputs = greedy(online)
    del online, engine
    from_file = LLM(q8_file, tokenizer=folder, max_model_len=256, enable_multiprocessing=False)
    assert from_file.llm_engine.quantization == "gguf"
    # The same blocks: the same bytes held, within 1.15x of the file's tensors.
    assert online_bytes == from_file.llm_engine.weight_memory_bytes
    assert online_bytes <= 1.15 * file_tensor_bytes(q8_file)
    assert greedy(from_file) == online_outputs


@pytest.mark.slow  # two loads and 72 tokens each (~30 s)
def test_q8_0s_refined_kernel_replays_in_a_cpu_graph_as_it_runs_eagerly(float_checkpoint):
    """Decode steps replayed from a CPU graph call the refined kernel through its slot twin:
    the same greedy tokens as eager steps, which call it from Python."""
    from minivllm import LLM

    folder, _ = float_checkpoint
    outputs = []
    for eager in (False, True):
        llm = LLM(
            folder,
            quantization="q8_0",
            max_model_len=256,
            enable_multiprocessing=False,
            enforce_eager=eager,
        )
        assert llm.llm_engine.quantization == "q8_0"
        outputs.append(greedy(llm))
        del llm
    assert outputs[0] == outputs[1]


def test_online_modes_need_the_cpu_in_float32(float_checkpoint):
    from minivllm.engine.arg_utils import ONLINE_QUANTIZATIONS, EngineArgs
    from minivllm.engine.create_config import create_vllm_config

    assert ONLINE_QUANTIZATIONS == tuple(ONLINE_TYPES)
    folder, _ = float_checkpoint
    config = create_vllm_config(EngineArgs(model=folder, quantization="q4_0"))
    assert config.model_config.quantization == "q4_0"
    assert config.model_config.dtype == "float32"
    with pytest.raises(ValueError, match="runs on the CPU in float32"):
        create_vllm_config(EngineArgs(model=folder, quantization="q4_0", dtype="bfloat16"))


def test_q4_0_holds_about_a_q4_0_files_bytes(float_checkpoint):
    """4.5 bits a weight for the layers, 8.5 for the (tied) head and embedding."""
    from safetensors import safe_open

    from minivllm.model.layers.quantization.base import weight_bytes
    from minivllm.model.loader import iter_weights, load_hf_config
    from minivllm.model.registry import resolve_model_class
    from minivllm.platforms import get_platform

    folder, _ = float_checkpoint
    config = load_hf_config(folder)
    backend = get_platform("cpu").create_attn_backend(16)
    model = resolve_model_class(config)(
        config, backend, quant_config=get_quantization_config("q4_0")
    )
    model.load_weights(iter_weights(folder, torch.float32, "q4_0"))
    process_weights_after_loading(model)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        shapes = [f.get_slice(name).get_shape() for name in f.keys()]
    matrices = sum(rows * cols for rows, cols in (s for s in shapes if len(s) == 2))
    embedding = config.vocab_size * config.hidden_size
    vectors = sum(p.numel() * 4 for n, p in model.named_parameters() if p.dim() == 1)
    expected = embedding * 34 // 32 + (matrices - embedding) * 18 // 32 + vectors
    assert expected <= weight_bytes(model) <= 1.15 * expected


def test_a_mixture_of_experts_keeps_its_routers_float_and_runs_its_experts_packed(
    tmp_path, smollm2_tokenizer
):
    """A tiny Qwen3-MoE checkpoint (untied head) quantized q8_0: its routers stay float, its
    experts run quantized in the one-call kernel, close to the float experts' output; its
    untied embedding and head are Q8_0 blocks."""
    from minivllm.model.layers.quantization.base import quantized_weight
    from minivllm.model.loader import iter_weights, load_hf_config
    from minivllm.model.registry import resolve_model_class
    from minivllm.platforms import get_platform
    from tests.conftest import write_tiny_checkpoint

    folder = write_tiny_checkpoint("qwen3-moe", str(tmp_path), smollm2_tokenizer)
    config = load_hf_config(folder)
    backend = get_platform("cpu").create_attn_backend(16)
    models = []
    for quantization in ("q8_0", None):
        model = resolve_model_class(config)(
            config, backend, quant_config=get_quantization_config(quantization)
        )
        model.load_weights(iter_weights(folder, torch.float32, quantization))
        process_weights_after_loading(model)
        models.append(model)
    quantized, dense = (m.model.layers[0].mlp for m in models)
    assert type(quantized.gate.quant_method) is UnquantizedLinearMethod
    assert quantized.experts.packed is not None
    model = models[0]
    assert quantized_weight(model.model.embed_tokens.weight) is not None
    assert quantized_weight(model.lm_head.weight) is not None
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    x = torch.randn(5, config.hidden_size)
    want = dense(x)
    assert (quantized(x) - want).norm() <= 0.03 * want.norm()


@pytest.mark.parametrize("arch", ["gemma3", "gemma4", "opt"])
def test_other_families_keep_their_token_tables_as_q8_0_blocks(arch, tmp_path, smollm2_tokenizer):
    """Gemma 3, Gemma 4 (its per-layer table too, where its width is whole blocks) and OPT
    hand the online config to their embeddings: the tables are gathered from Q8_0 blocks."""
    from minivllm.model.layers.quantization.base import quantized_weight
    from minivllm.model.loader import iter_weights, load_hf_config
    from minivllm.model.registry import resolve_model_class
    from minivllm.platforms import get_platform
    from tests.conftest import write_tiny_checkpoint

    folder = write_tiny_checkpoint(arch, str(tmp_path), smollm2_tokenizer)
    config = load_hf_config(folder)
    backend = get_platform("cpu").create_attn_backend(16)
    model = resolve_model_class(config)(
        config, backend, quant_config=get_quantization_config("q8_0")
    )
    floats = dict(iter_weights(folder, torch.float32))
    model.load_weights(iter(floats.items()))
    process_weights_after_loading(model)
    tables = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
    }
    assert any(name.endswith(".embed_tokens") for name in tables)
    for name, module in tables.items():
        table = floats[f"{name}.weight"]
        if name.endswith("embed_positions") or table.shape[1] % 32:
            assert quantized_weight(module.weight) is None, name  # OPT's positions: float
            continue
        assert quantized_weight(module.weight) is not None, name
        ids = torch.tensor([0, 5, table.shape[0] - 1])
        expected = reference_blocks(table, "Q8_0").dequantize()[ids]
        torch.testing.assert_close(module.lookup(ids), expected, rtol=0, atol=0)
