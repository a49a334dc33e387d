"""Gemma 4: which layers share K/V (as HF's config says), the cache only the others hold,
two tensor-parallel ranks, the multimodal checkpoints' names and llama.cpp's GGUF layout.
Single-rank greedy parity with HF is in test_hf_parity_archs.py ("gemma4", "gemma4-moe")."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.kernels import gguf_kernels
from minivllm.model.loader import iter_weights, load_hf_config
from minivllm.model.models.gemma4 import _layer_shape, kv_sharing_targets
from tests.conftest import write_tiny_checkpoint
from tests.model.test_gguf_phi3 import assert_f32_kernel_greedy_equals_hf, assert_greedy_equals_hf
from tests.model.test_hf_parity_archs import (
    PROMPTS,
    assert_two_ranks_give_hf_greedy_outputs,
    hf_greedy_with_logprobs,
)
from tests.model.test_loader import _GEMMA_TO_GGUF
from tests.model.test_loader import _TOP as _LOADER_TOP
from tests.worker.test_profile_run import loaded_worker


@pytest.fixture(scope="module", params=["gemma4", "gemma4-moe"])
def gemma4_model(request, tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp(request.param)
    return write_tiny_checkpoint(request.param, str(folder), smollm2_tokenizer)


@pytest.mark.parametrize(
    "layer_types, shared",
    [
        (["sliding_attention", "sliding_attention", "full_attention"] * 2, 2),
        # HF's default: five sliding layers to one global, the last 20 of 35 sharing (E2B).
        (None, 20),
        (["full_attention", "sliding_attention", "sliding_attention", "full_attention"], 1),
    ],
)
def test_kv_sharing_targets_are_hfs(layer_types, shared):
    config = transformers.Gemma4TextConfig(
        num_hidden_layers=len(layer_types) if layer_types else 35,
        layer_types=layer_types,
        num_kv_shared_layers=shared,
    )
    targets = kv_sharing_targets(config)
    modes = config.kv_sharing_modes
    assert [t is not None for t in targets] == [m == "reuse" for m in modes]
    for i, target in enumerate(targets):
        if target is not None:  # HF's consumer reads what the last producer of its kind stores
            assert modes[target] == "store"
            assert config.layer_types[target] == config.layer_types[i]


def test_sharing_layers_hold_no_cache(tmp_path, smollm2_tokenizer):
    """Six layers, the last two sharing: four caches, each of its own layer's shape."""
    folder = write_tiny_checkpoint("gemma4", str(tmp_path), smollm2_tokenizer)
    worker = loaded_worker(folder, max_model_len=64, enable_multiprocessing=False)
    worker.initialize_kv_cache(8)
    shapes = [tuple(c.shape) for c in worker.kv_caches]
    assert len(shapes) == 4
    layers = worker.model_runner.model.model.layers
    assert layers[4].self_attn.attn.kv_sharing_target is layers[3].self_attn.attn
    assert layers[5].self_attn.attn.kv_sharing_target is layers[2].self_attn.attn
    # Sliding layers: 2 KV heads of 32; global ones: 1 KV head of 64.
    assert shapes[2] != shapes[0] and shapes[0] == shapes[1] == shapes[3]


def test_two_ranks_give_hf_greedy_outputs(gemma4_model):
    """The global layers' single KV head is replicated on both ranks."""
    assert_two_ranks_give_hf_greedy_outputs(gemma4_model)


def test_multimodal_checkpoint_serves_its_language_model(tmp_path, smollm2_tokenizer):
    """A Gemma4ForConditionalGeneration checkpoint (names under model.language_model, a
    vision tower beside them, the text config nested) gives the text model's tokens."""
    text = write_tiny_checkpoint("gemma4", str(tmp_path / "text"), smollm2_tokenizer)
    folder = tmp_path / "mm"
    folder.mkdir()
    weights = load_file(os.path.join(text, "model.safetensors"))
    renamed = {
        name.replace("model.", "model.language_model.", 1): tensor
        for name, tensor in weights.items()
    }
    renamed["model.vision_tower.patch_embedder.weight"] = torch.zeros(4, 4)
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(text, "config.json")) as f:
        text_config = json.load(f)
    config = transformers.Gemma4Config(text_config=text_config, vision_config=None)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    config.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        text, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    llm = LLM(str(folder), max_model_len=128, enable_multiprocessing=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (output,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    tokens, _ = hf_greedy_with_logprobs(hf, output.prompt_token_ids, 16)
    assert output.outputs[0].token_ids == tokens


# HF module name (after "model.layers.N.") -> llama.cpp's, as its converter writes Gemma 4:
# Gemma's (test_loader's table) with the experts' norms, the router and the per-layer
# embeddings' gate, projection and norm.
_TO_GGUF = {
    **_GEMMA_TO_GGUF,
    "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1": "post_ffw_norm_1",
    "post_feedforward_layernorm_2": "post_ffw_norm_2",
    "router.proj": "ffn_gate_inp",
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
}
_TOP = {
    **_LOADER_TOP,
    "model.embed_tokens_per_layer": "per_layer_token_embd",
    "model.per_layer_model_projection": "per_layer_model_proj",
    "model.per_layer_projection_norm": "per_layer_proj_norm",
}
# Whole names: the router's scales and the layer's output scale.
_WHOLE = {
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "layer_scalar": "layer_output_scale.weight",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",  # [E, 2I, H] kept fused
    "experts.down_proj": "ffn_down_exps.weight",
}


def write_gemma4_gguf(path: str, hf, qtype_name: str | None) -> dict:
    """A gemma4 GGUF as llama.cpp's converter writes one (metadata, names, the global layers'
    RoPE as rope_freqs); the matrices whose rows are whole blocks in qtype_name (None: all
    float32). Returns HF's state dict of the weights the file holds (dequantized)."""
    import gguf

    config = hf.config
    layers = config.num_hidden_layers
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    head_dim, kv_heads = _layer_shape(config, 0)
    global_head_dim, global_kv_heads = _layer_shape(config, full[0])
    shared = config.num_kv_shared_layers
    writer = gguf.GGUFWriter(path, "gemma4")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    wide = [2 if config.use_double_wide_mlp and i >= layers - shared else 1 for i in range(layers)]
    ff = [config.intermediate_size * w for w in wide]
    writer.add_feed_forward_length(ff if len(set(ff)) > 1 else ff[0])
    writer.add_block_count(layers)
    writer.add_head_count(config.num_attention_heads)
    kinds = config.layer_types
    writer.add_head_count_kv(
        [global_kv_heads if k == "full_attention" else kv_heads for k in kinds]
        if global_kv_heads != kv_heads
        else kv_heads
    )
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(head_dim)
    writer.add_value_length_swa(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([k == "sliding_attention" for k in kinds])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(global_head_dim)
    writer.add_rope_dimension_count_swa(head_dim)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.enable_moe_block:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.top_k_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    turned = int(rope["full_attention"]["partial_rotary_factor"] * global_head_dim / 2)
    freqs = [1.0] * turned + [1e30] * (global_head_dim // 2 - turned)
    writer.add_tensor("rope_freqs.weight", np.array(freqs, dtype=np.float32))

    qtype = gguf.GGMLQuantizationType[qtype_name] if qtype_name else None
    held = {}
    for name, tensor in hf.state_dict().items():
        if name.startswith("model.layers."):
            layer, rest = name.split(".")[2], name.split(".", 3)[3]
            if rest in _WHOLE:
                gguf_name = f"blk.{layer}.{_WHOLE[rest]}"
            else:
                module, kind = rest.rsplit(".", 1)
                gguf_name = f"blk.{layer}.{_TO_GGUF[module]}.{kind}"
        else:
            module, kind = name.rsplit(".", 1)
            gguf_name = f"{_TOP[module]}.{kind}"
        array = tensor.contiguous().numpy().astype(np.float32)
        if qtype is None or array.ndim < 2 or array.shape[-1] % 32:
            writer.add_tensor(gguf_name, array)
            held[name] = tensor
            continue
        blocks = gguf.quants.quantize(array, qtype)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        held[name] = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def hf_model(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def gemma4_hf(gemma4_model):
    return gemma4_model, hf_model(gemma4_model)


def test_gguf_config_and_weights(tmp_path, gemma4_hf):
    folder, hf = gemma4_hf
    path = str(tmp_path / "gemma4.gguf")
    write_gemma4_gguf(path, hf, None)
    config = load_hf_config(path)
    assert config.architectures == ["Gemma4ForCausalLM"]
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "layer_types",
        "sliding_window",
        "num_kv_shared_layers",
        "attention_k_eq_v",
        "hidden_size_per_layer_input",
        "final_logit_softcapping",
        "enable_moe_block",
        "num_experts",
        "top_k_experts",
        "moe_intermediate_size",
        "rope_parameters",
        "tie_word_embeddings",
    ):
        # (unset, False, 0, None: the same)
        assert (getattr(config, field, None) or None) == (getattr(hf.config, field) or None), field

    # Double-wide MLPs are those of the layers sharing K/V (none in "gemma4-moe").
    def wide(c) -> bool:
        return bool(getattr(c, "use_double_wide_mlp", False) and c.num_kv_shared_layers)

    assert wide(config) == wide(hf.config)
    layers = range(config.num_hidden_layers)
    assert [_layer_shape(config, i) for i in layers] == [_layer_shape(hf.config, i) for i in layers]
    weights = dict(iter_weights(path, torch.float32))
    state = hf.state_dict()
    assert torch.equal(weights["model.layers.1.layer_scalar"], state["model.layers.1.layer_scalar"])
    if hf.config.enable_moe_block:
        gate_up = state["model.layers.0.experts.gate_up_proj"][3]
        assert torch.equal(weights["model.layers.0.experts.3.up_proj.weight"], gate_up[32:])
        scale = state["model.layers.0.router.per_expert_scale"]
        assert torch.equal(weights["model.layers.0.router.per_expert_scale"], scale)


def test_gguf_greedy_outputs_equal_hf(tmp_path, gemma4_hf):
    folder, hf = gemma4_hf
    path = str(tmp_path / "gemma4.gguf")
    write_gemma4_gguf(path, hf, None)
    assert_greedy_equals_hf(path, folder, hf, quantization="none")


def test_quantized_gguf_kept_quantized_equals_hf_on_its_weights(tmp_path, gemma4_hf, monkeypatch):
    """Q8_0 matrices (the per-layer embedding table too) kept as blocks, through the float32
    kernel: HF's greedy tokens on the dequantized weights."""
    folder, hf = gemma4_hf
    path = str(tmp_path / "gemma4-q8_0.gguf")
    held = write_gemma4_gguf(path, hf, "Q8_0")
    quantized = dict(iter_weights(path, torch.float32, quantization="gguf"))
    assert hasattr(quantized["model.layers.0.mlp.down_proj.weight"], "qtype")
    assert_f32_kernel_greedy_equals_hf(path, folder, type(hf), hf.config, held, monkeypatch)


@pytest.fixture(scope="module")
def gemma4_sharing(tmp_path_factory, smollm2_tokenizer):
    """The "gemma4" checkpoint (its last two layers read earlier layers' K/V) and HF's model."""
    folder = write_tiny_checkpoint("gemma4", str(tmp_path_factory.mktemp("g4")), smollm2_tokenizer)
    return folder, hf_model(folder)


def test_fast_prefill_gives_hf_outputs(gemma4_sharing):
    """kv_sharing_fast_prefill: the sharing layers compute only the sampled rows, in chunked
    prefill and in steps mixing prompts with decodes; greedy tokens and logprobs as HF's."""
    folder, hf = gemma4_sharing
    assert_greedy_equals_hf(folder, folder, hf, kv_sharing_fast_prefill=True)


def test_fast_prefill_computes_every_row_for_prompt_logprobs(gemma4_sharing):
    folder, _ = gemma4_sharing
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    results = []
    for fast in (False, True):
        llm = LLM(
            folder, max_model_len=128, enable_multiprocessing=False, kv_sharing_fast_prefill=fast
        )
        results.append(llm.generate(PROMPTS, params, use_tqdm=False))
    for slow, fast in zip(*results, strict=True):
        assert fast.outputs[0].token_ids == slow.outputs[0].token_ids
        expected = [None] + [
            pytest.approx({t: lp.logprob for t, lp in step.items()}, abs=1e-5)
            for step in slow.prompt_logprobs[1:]
        ]
        got = [None] + [
            {t: lp.logprob for t, lp in step.items()} for step in fast.prompt_logprobs[1:]
        ]
        assert got == expected


@pytest.mark.skipif(gguf_kernels.load_gguf_kernels() is None, reason="no C compiler")
def test_experts_run_in_one_kernel_call_and_steps_replay(tmp_path, monkeypatch, smollm2_tokenizer):
    """26B-A4B's kind: the experts (gelu, a scale per expert) in one kernel call give the
    outputs of running them one by one, and decode steps replay as CPU graphs with the
    eager steps' tokens."""
    from tests.model.test_gguf_moe import assert_one_call_is_one_by_one, model_with_kept_blocks
    from tests.worker.test_cpu_graph import run

    folder = write_tiny_checkpoint("gemma4-moe", str(tmp_path / "hf"), smollm2_tokenizer)
    hf = hf_model(folder)
    path = str(tmp_path / "gemma4-moe-q8_0.gguf")
    write_gemma4_gguf(path, hf, "Q8_0")
    moe = model_with_kept_blocks(path).model.layers[1].experts
    assert moe.packed is not None and moe.packed.gelu
    assert torch.equal(moe.packed.expert_scale, hf.model.layers[1].router.per_expert_scale)
    assert_one_call_is_one_by_one(moe, scale=3.0, atol=1e-5)

    replayed, graphs = run(monkeypatch, "1", "gguf", path, tokenizer=folder)
    eager, _ = run(monkeypatch, "0", "gguf", path, tokenizer=folder)
    assert replayed == eager
    assert sorted(size for size, graph in graphs.items() if graph is not None) == [1, 2, 3, 4, 5, 6]


def test_bfloat16_greedy_equals_hf(gemma4_sharing):
    """In bfloat16 (released checkpoints' dtype) HF's order matters: norms scale in float32
    before the cast, and the final logits are soft-capped in bfloat16 (as vLLM does)."""
    folder, _ = gemma4_sharing
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    llm = LLM(folder, max_model_len=128, enable_multiprocessing=False, dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        tokens, _ = hf_greedy_with_logprobs(hf, output.prompt_token_ids, 24)
        assert output.outputs[0].token_ids == tokens


def test_int8k_int8v_calibrates_layers_of_two_head_sizes(gemma4_model):
    """The start-up key calibration (worker/dummy_forward.py) over global and local layers
    of different head sizes: each layer gets factors of its own shape."""
    llm = LLM(
        gemma4_model, max_model_len=128, enable_multiprocessing=False, kv_cache_dtype="int8k_int8v"
    )
    layers = llm.llm_engine.engine_core.engine_core.executor.worker.model.attention_layers()
    assert len({(a.num_kv_heads, a.head_dim) for a in layers}) == 2
    assert all(a.key_factors.shape == (a.num_kv_heads, a.head_dim) for a in layers)
