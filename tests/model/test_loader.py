import itertools
import math
import os

import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
)

from minivllm.model.loader import (
    default_model_path,
    iter_weights,
    load_hf_config,
    read_gguf_header,
    resolve_model_path,
)
from tests.conftest import GRANITE_SCALES


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def reference_state_dict(gguf_path: str, smollm2_path: str, smollm2_hf) -> dict[str, torch.Tensor]:
    """The state dict transformers itself builds from the GGUF file (the session's model)."""
    assert os.path.samefile(gguf_path, smollm2_path)
    return smollm2_hf.state_dict()


def test_gguf_weights_match_transformers(
    gguf_path: str, reference_state_dict: dict[str, torch.Tensor]
) -> None:
    weights = dict(iter_weights(gguf_path, torch.float32))
    # The GGUF has no output.weight: the head is tied to the embedding and not yielded.
    assert set(weights) == set(reference_state_dict) - {"lm_head.weight"}
    for name, tensor in weights.items():
        expected = reference_state_dict[name]
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected.shape, name
        # Exact: both dequantize the same blocks; q/k also checks the rotary un-permutation.
        assert torch.equal(tensor, expected), name


def test_gguf_weights_cast_to_dtype(gguf_path: str) -> None:
    for name, tensor in itertools.islice(iter_weights(gguf_path, torch.bfloat16), 4):
        assert tensor.dtype == torch.bfloat16, name


def test_gguf_config(gguf_path: str) -> None:
    config = load_hf_config(gguf_path)
    folder, name = os.path.split(gguf_path)
    reference = AutoConfig.from_pretrained(folder, gguf_file=name)

    assert config.architectures == ["LlamaForCausalLM"]
    assert config.model_type == "llama"
    assert config.tie_word_embeddings is True
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert getattr(config, field) == getattr(reference, field), field
    assert (config.head_dim, config.bos_token_id, config.eos_token_id) == (64, 1, 2)
    # GGUF stores float32; the config gets the decimal SmolLM2's config.json has.
    assert config.rms_norm_eps == 1e-5
    assert config.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}


def test_gguf_header_matches_gguf_reader(gguf_path: str) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    header = read_gguf_header(gguf_path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    assert header.tensor_shapes == shapes
    for key, value in header.metadata.items():
        expected = reader.fields[key].contents()
        assert (value.tolist() if hasattr(value, "tolist") else value) == expected, key
    string_arrays = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "general.languages"}
    assert set(reader.fields) - set(header.metadata) - string_arrays == {
        "GGUF.version",
        "GGUF.tensor_count",
        "GGUF.kv_count",
    }


def save_tiny_llama(folder, **save_kwargs) -> LlamaForCausalLM:
    """A small random untied Llama saved as safetensors in folder; returns the model."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, **save_kwargs)
    return model


@pytest.mark.parametrize("max_shard_size", [None, "100KB"])
def test_safetensors_round_trip(tmp_path, max_shard_size: str | None) -> None:
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model = save_tiny_llama(tmp_path, **kwargs)
    sharded = (tmp_path / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_size is not None)
    if sharded:
        assert len(list(tmp_path.glob("*.safetensors"))) > 1

    path = resolve_model_path(str(tmp_path))
    expected = model.state_dict()
    weights = dict(iter_weights(path, torch.float32))
    assert set(weights) == set(expected)
    assert "lm_head.weight" in weights
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name

    halves = dict(iter_weights(path, torch.float16))
    assert all(t.dtype == torch.float16 for t in halves.values())
    assert torch.equal(halves["model.norm.weight"], expected["model.norm.weight"].half())

    loaded = load_hf_config(path)
    assert loaded.architectures == ["LlamaForCausalLM"]
    assert (loaded.hidden_size, loaded.num_key_value_heads) == (64, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_safetensors_weights_are_read_onto_the_gpu(tmp_path) -> None:
    expected = save_tiny_llama(tmp_path).state_dict()
    on_gpu = dict(iter_weights(str(tmp_path), torch.bfloat16, device="cuda"))
    assert set(on_gpu) == set(expected)
    for name, tensor in on_gpu.items():
        assert tensor.is_cuda and tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor.cpu(), expected[name].bfloat16()), name


def test_resolve_model_path(tmp_path, gguf_path: str) -> None:
    assert resolve_model_path(None) == gguf_path
    assert resolve_model_path(gguf_path) == gguf_path

    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="model path does not exist"):
        resolve_model_path(missing)
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"")
    with pytest.raises(ValueError, match=".gguf"):
        resolve_model_path(str(not_gguf))


def test_missing_path_raises(tmp_path) -> None:
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError):
        iter_weights(missing, torch.float32)
    with pytest.raises(FileNotFoundError):
        load_hf_config(missing)
    # A directory without safetensors fails up front, not at the first next().
    with pytest.raises(FileNotFoundError, match="safetensors"):
        iter_weights(str(tmp_path), torch.float32)


# HF module name -> llama.cpp name, written out independently of the loader's table.
_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# Gemma's four norms a layer; llama.cpp's ffn_norm is the one before the MLP there.
_GEMMA_TO_GGUF = {
    **_TO_GGUF,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


# GLM-4's four norms a layer, and its fused gate/up.
_GLM4_TO_GGUF = {
    **_TO_GGUF,
    "post_self_attn_layernorm": "post_attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "post_mlp_layernorm": "post_ffw_norm",
    "mlp.gate_up_proj": "ffn_up",
}


# The model-wide tensors' llama.cpp names.
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module in _TOP:
        return f"{_TOP[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    names = _GEMMA_TO_GGUF if arch.startswith("gemma") or arch == "olmo2" else _TO_GGUF
    names = _GLM4_TO_GGUF if arch == "glm4" else names
    return f"blk.{layer}.{names[rest]}.{kind}"


# The architectures llama.cpp's llama converter (or a subclass of it) writes, q/k permuted.
LLAMA_LAYOUT = ("llama", "smollm3", "granite", "granitemoe")


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's converter does to llama q/k rows: per head, interleave the halves.
    shape = weight.shape
    return (
        weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def _llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores for llama3 rope scaling: per frequency, the number
    HF's scaled frequency divides the plain one by (1 when kept, factor when stretched)."""
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < context / high:
            divisors.append(1.0)
        elif wavelen > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


_GRID_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")


def _grid_blocks(array: np.ndarray, qtype) -> np.ndarray:
    """Blocks of an IQ1-IQ3 type, which gguf cannot quantize to: random grid indices, signs
    and scales, drawn per row from the row's bytes (so that permuting the rows permutes the
    blocks), and d making each block's largest weight the array's. Not a quantization of
    the array, but a model at its scale: the tests' reference is the blocks' own weights."""
    import zlib

    import gguf

    from tests.kernels.test_gguf_kernels import set_iq1_m_d

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    per_row = (array.shape[1] // block, size)
    draws = [np.random.default_rng(zlib.crc32(row.tobytes())) for row in array]
    blocks = np.stack([r.integers(0, 256, per_row, np.uint8) for r in draws]).reshape(-1, size)

    def set_d(d: np.ndarray) -> None:
        if qtype == gguf.GGMLQuantizationType.IQ1_M:
            set_iq1_m_d(blocks, d)
        else:
            blocks[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)

    set_d(np.ones(len(blocks)))
    unit = np.abs(gguf.quants.dequantize(blocks, qtype)).max(-1)
    set_d(np.abs(array.reshape(-1, block)).max(-1) / np.maximum(unit, 1e-3))
    return blocks.reshape(array.shape[0], -1)


def _quantize(array: np.ndarray, qtype) -> np.ndarray:
    """gguf's quantization, and for IQ4_NL (which gguf lacks) the nearest of its levels
    under a scale of max |w| / 127 per 32 weights: blocks as a file stores them; for the
    IQ1-IQ3 types, _grid_blocks."""
    import gguf

    if qtype.name in _GRID_TYPES:
        return _grid_blocks(array, qtype)
    if qtype != gguf.GGMLQuantizationType.IQ4_NL:
        return gguf.quants.quantize(array, qtype)
    levels = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
    blocks = array.reshape(-1, 32)
    d = (np.abs(blocks).max(-1, keepdims=True) / 127).astype(np.float16)
    scaled = blocks / np.where(d == 0, 1, d).astype(np.float32)
    index = np.abs(scaled[..., None] - levels).argmin(-1).astype(np.uint8)
    nibbles = index[:, :16] | (index[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8), nibbles], axis=1).reshape(array.shape[0], -1)


def _write_gguf(
    path: str,
    arch: str,
    config: PretrainedConfig,
    state: dict,
    qtypes: dict | None = None,
    pooling_type: int | None = None,
) -> dict:
    """Write a float32 GGUF the way llama.cpp's converter lays out an HF checkpoint; qtypes
    quantizes the matrices whose llama.cpp name contains a key (e.g. {"attn_q": "Q8_0"});
    pooling_type (llama.cpp's enum: 1 mean, 2 cls, 3 last) makes it an embedding model's.
    Returns the weights the file holds, dequantized, under HF's names."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    # Qwen2Config has no head_dim attribute; its models use hidden_size / heads.
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)  # OLMo 3's
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "gemma2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "olmo2" and getattr(config, "sliding_window", None):  # OLMo 3, as llama.cpp
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
        swa = config.rope_parameters.get("sliding_attention", {}).get("rope_theta")
        if swa is not None and swa != rope["rope_theta"]:
            writer.add_key_value("olmo2.rope.freq_base_swa", swa, gguf.GGUFValueType.FLOAT32)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "glm4":
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    if arch == "granite":
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(config.rope_parameters, head_dim))
    held = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = _gguf_name(name, arch)
        array = tensor.numpy().copy()
        qtype = next((t for part, t in (qtypes or {}).items() if part in gguf_name), None)
        qtype = qtype if array.ndim == 2 else None  # matrices only, as llama.cpp
        held[name] = tensor
        if qtype is not None:  # blocks are per row: the permutation below moves whole rows
            qtype = gguf.GGMLQuantizationType[qtype]
            blocks = _quantize(array, qtype)
            held[name] = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())
        if arch in LLAMA_LAYOUT and ".q_proj." in name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif arch in LLAMA_LAYOUT and ".k_proj." in name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp stores Gemma's norms as the (1 + w) they scale by
        if qtype is None:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, _quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("llama", {"attention_bias": True, "tie_word_embeddings": False}),
        ("qwen2", {"tie_word_embeddings": True}),
        # head_dim != hidden_size / num_heads, as in Qwen3.
        ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
        # RoPE left out of every fourth layer (llama.cpp's fixed step): 8 layers, two NoPE.
        # (its config's default special ids are Llama 3's: in this vocabulary's range here)
        (
            "smollm3",
            {"num_hidden_layers": 8, "tie_word_embeddings": True}
            | {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        ),
        # Granite's scales, as its converter writes them.
        ("granite", GRANITE_SCALES),
        # OLMo 2: norms after the sublayers, q/k norms over the projection; HF's layout.
        ("olmo2", {"pad_token_id": 0, "tie_word_embeddings": False}),
    ],
)
def test_synthetic_gguf_round_trip(tmp_path, arch: str, extra: dict) -> None:
    """HF checkpoint -> GGUF laid out like llama.cpp's converter -> loader gives it back."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        arch,
        **{
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
            **extra,
        },
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    state = model.state_dict()
    path = str(tmp_path / f"{arch}.gguf")
    _write_gguf(path, arch, config, state)

    loaded_config = load_hf_config(path)
    assert loaded_config.model_type == arch
    assert loaded_config.architectures == [type(model).__name__]
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "tie_word_embeddings",
    ):
        assert getattr(loaded_config, field) == getattr(config, field), field
    assert loaded_config.head_dim == getattr(config, "head_dim", 16)
    if arch == "llama":
        assert loaded_config.attention_bias is True
    if arch == "smollm3":
        assert loaded_config.no_rope_layers == config.no_rope_layers == [1, 1, 1, 0] * 2
    scales = ("embedding_multiplier", "residual_multiplier", "attention_multiplier")
    for field in (*scales, "logits_scaling") if arch == "granite" else ():
        assert getattr(loaded_config, field) == getattr(config, field) != 1.0, field

    weights = dict(iter_weights(path, torch.float32))
    expected = set(state) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    assert set(weights) == expected
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name

    # The reloaded model computes the same logits as the original. The loader's config is a
    # plain PretrainedConfig (see load_gguf_config); transformers needs its model's own class.
    fields = {k: v for k, v in loaded_config.to_dict().items() if k != "model_type"}
    fields["pad_token_id"] = config.pad_token_id  # not in these files; no effect on logits
    hf_config = AutoConfig.for_model(arch, **fields)
    reloaded = AutoModelForCausalLM.from_config(hf_config).eval()
    reloaded.load_state_dict(weights, strict=not config.tie_word_embeddings)
    reloaded.tie_weights()
    ids = torch.tensor([[1, 5, 9, 42, 7, 100]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


# SmolLM3: llama's layout, RoPE left out of every fourth layer (a step the file does not
# state); Granite: llama's layout with four scales; OLMo 2: norms after the sublayers; OLMo
# 3: an olmo2 file with windows on three layers of four (its pattern, a RoPE base of their
# own) and YaRN on the fourth; GLM-4: four norms a layer, RoPE on half of each head in
# interleaved pairs, gate/up fused (ffn_up); ERNIE 4.5: interleaved pairs over whole heads.
@pytest.mark.parametrize("arch", ["smollm3", "granite", "olmo2", "olmo3", "glm4", "ernie4_5"])
def test_llama_like_gguf_gives_hf_greedy_outputs(
    tmp_path, smollm2_tokenizer, monkeypatch, arch
) -> None:
    """The engine generates HF's greedy tokens from the GGUF, in float32 and with the
    attention's matrices kept in Q8_0."""
    import transformers

    from tests.conftest import write_tiny_checkpoint
    from tests.model.test_gguf_phi3 import (
        assert_f32_kernel_greedy_equals_hf,
        assert_greedy_equals_hf,
    )

    folder = write_tiny_checkpoint(arch, str(tmp_path / "hf"), smollm2_tokenizer)
    cls = {
        "smollm3": transformers.SmolLM3ForCausalLM,
        "granite": transformers.GraniteForCausalLM,
        "olmo2": transformers.Olmo2ForCausalLM,
        "olmo3": transformers.Olmo3ForCausalLM,
        "glm4": transformers.Glm4ForCausalLM,
        "ernie4_5": transformers.Ernie4_5ForCausalLM,
    }
    hf = cls[arch].from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    path = str(tmp_path / f"{arch}.gguf")
    gguf_arch = {"olmo3": "olmo2"}.get(arch, arch)  # llama.cpp writes OLMo 3 as olmo2
    _write_gguf(path, gguf_arch, hf.config, hf.state_dict())
    config = load_hf_config(path)
    assert config.architectures == [cls[arch].__name__]
    if arch == "olmo3":
        for field in ("sliding_window", "layer_types", "rope_parameters"):
            assert getattr(config, field) == getattr(hf.config, field), field
    assert_greedy_equals_hf(path, folder, hf)

    quantized = str(tmp_path / f"{arch}-q8_0.gguf")
    held = _write_gguf(quantized, gguf_arch, hf.config, hf.state_dict(), {"attn": "Q8_0"})
    assert_f32_kernel_greedy_equals_hf(quantized, folder, cls[arch], hf.config, held, monkeypatch)


def test_llama3_gguf_rope_freqs_give_hf_greedy_outputs(tmp_path, smollm2_tokenizer) -> None:
    """A Llama 3.x GGUF holds its rope scaling as rope_freqs, one divisor per frequency: the
    engine divides by them and generates HF's greedy tokens from the llama3 checkpoint."""
    from minivllm import LLM, SamplingParams
    from minivllm.model.layers.rotary import RotaryEmbedding, rope_parameters
    from tests.conftest import write_tiny_checkpoint

    folder = write_tiny_checkpoint("llama3", str(tmp_path / "hf"), smollm2_tokenizer)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = str(tmp_path / "llama3.gguf")
    _write_gguf(path, "llama", hf.config, hf.state_dict())

    config = load_hf_config(path)
    factors = config.rope_parameters["freq_factors"]
    assert config.rope_parameters["rope_type"] == "default"
    assert max(factors) == 8.0 and any(1 < f < 8 for f in factors)  # stretched and blended
    # The tables equal HF's llama3 ones up to float32 rounding of the divisors.
    head_dim, positions = 16, 512
    ours = RotaryEmbedding(head_dim, positions, rope_parameters(config), torch.float32)
    theirs = hf.model.rotary_emb(torch.zeros(1), torch.arange(positions)[None])
    torch.testing.assert_close(ours.cos, theirs[0][0], atol=2e-5, rtol=0)
    torch.testing.assert_close(ours.sin, theirs[1][0], atol=2e-5, rtol=0)
    plain = RotaryEmbedding(head_dim, positions, {"rope_theta": 10000.0}, torch.float32)
    assert (plain.cos - ours.cos).abs().max() > 0.5  # the factors change the rotation

    # The file's weights with the checkpoint's tokenizer; 48 tokens past the 16 positions
    # the tiny model's llama3 scaling was "trained" on.
    llm = LLM(path, tokenizer=folder, max_model_len=128, enable_multiprocessing=False)
    prompts = ["Hello, my name is", "def quicksort(arr):\n    if len(arr) <= 1:\n"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ids = output.prompt_token_ids
        with torch.inference_mode():
            expected = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=48,
                do_sample=False,
                eos_token_id=-1,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert output.outputs[0].token_ids == expected, prompt


def test_gemma2_gguf_gives_hf_greedy_outputs_and_logprobs(tmp_path, smollm2_tokenizer) -> None:
    """A Gemma 2 GGUF (every other layer sliding, soft-capped scores and logits, norms
    stored with their 1 added) generates HF's greedy tokens from the original checkpoint."""
    from transformers import Gemma2ForCausalLM

    from minivllm import LLM, SamplingParams
    from tests.conftest import write_tiny_checkpoint
    from tests.model.test_hf_parity_archs import hf_greedy_with_logprobs

    folder = write_tiny_checkpoint("gemma2", str(tmp_path / "hf"), smollm2_tokenizer)
    # A GGUF file does not hold query_pre_attn_scalar: llama.cpp takes head_dim.
    hf = Gemma2ForCausalLM.from_pretrained(
        folder, dtype=torch.float32, query_pre_attn_scalar=32, attn_implementation="eager"
    ).eval()
    path = str(tmp_path / "gemma2.gguf")
    _write_gguf(path, "gemma2", hf.config, hf.state_dict())

    config = load_hf_config(path)
    assert config.architectures == ["Gemma2ForCausalLM"]
    for field in (
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "rope_parameters",
        "head_dim",
    ):
        assert getattr(config, field) == getattr(hf.config, field), field

    llm = LLM(path, tokenizer=folder, max_model_len=128, enable_multiprocessing=False)
    prompts = ["Hello, my name is", "def quicksort(arr):\n    if len(arr) <= 1:\n"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        tokens, logprobs = hf_greedy_with_logprobs(hf, output.prompt_token_ids, 32)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, prompt
        ours = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        assert ours == pytest.approx(logprobs, abs=1e-4), prompt
