"""Phi-3 GGUF files: fused attn_qkv and ffn_up (gate and up), read dequantized or as blocks.

Each file is written from a tiny HF checkpoint the way llama.cpp's converter lays out a
Phi3ForCausalLM (written here, independently of the loader's tables); the engine's greedy
tokens on it equal HF's on the checkpoint's weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.kernels import gguf_kernels
from minivllm.model.layers.quantization.gguf import GGUFConfig
from minivllm.model.loader import iter_weights, load_hf_config, read_gguf_header
from minivllm.model.registry import resolve_model_class
from minivllm.platforms import get_platform
from tests.conftest import write_tiny_checkpoint
from tests.model.gguf_writing import add_weight, finish
from tests.model.test_hf_parity_archs import hf_greedy_with_logprobs
from tests.model.test_loader import _TOP

# HF module name -> llama.cpp tensor name, for phi3.
_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
Q8_0, Q4_0 = gguf_kernels.SUPPORTED_TYPES["Q8_0"], gguf_kernels.SUPPORTED_TYPES["Q4_0"]
PROMPTS = ["Hello, my name is", "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n"]
MAX_NEW = 32


def _gguf_name(name: str) -> str:
    module, kind = name.rsplit(".", 1)
    if module in _TOP:
        return f"{_TOP[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}.{kind}"


def write_phi3_gguf(path: str, config, state: dict, qtypes: dict[str, str] | None = None) -> dict:
    """A phi3 GGUF as llama.cpp's converter writes one; qtypes quantizes the matrices whose
    llama.cpp name contains a key (e.g. {"attn_qkv": "Q8_0"}). Returns the weights the file
    holds, dequantized, under HF's names."""
    import gguf

    writer = gguf.GGUFWriter(path, "phi3")
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.sliding_window or 0)  # 0: none (Phi-4 mini)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope.get("rope_type") == "longrope":
        scale = config.max_position_embeddings / config.original_max_position_embeddings
        log_ratio = np.log(scale) / np.log(config.original_max_position_embeddings)
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + log_ratio)))
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    held = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = _gguf_name(name)
        array = tensor.numpy().astype(np.float32)
        qtype = next((t for part, t in (qtypes or {}).items() if part in gguf_name), None)
        held[name] = add_weight(writer, gguf_name, array, qtype)
    finish(writer)
    return held


def assert_greedy_equals_hf(path: str, folder: str, hf, max_new: int = MAX_NEW, **llm_kwargs):
    llm = LLM(
        path,
        tokenizer=folder,
        max_model_len=128,
        max_num_batched_tokens=16,  # the longer prompt in chunks
        enable_multiprocessing=False,
        **llm_kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        tokens, logprobs = hf_greedy_with_logprobs(hf, output.prompt_token_ids, max_new)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, prompt
        ours = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        assert ours == pytest.approx(logprobs, abs=1e-4), prompt


def assert_f32_kernel_greedy_equals_hf(path, folder, hf_cls, config, held, monkeypatch):
    """The quantized GGUF at ``path`` through the float32 kernel (the exact products of its
    dequantized weights) gives HF's greedy tokens on those weights: ``held``, under HF's
    names (an HF model of ``hf_cls`` with a tied head takes it from the embedding)."""
    hf_q = hf_cls(config).eval()
    hf_q.load_state_dict(held, strict=False)
    hf_q.tie_weights()
    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")
    assert_greedy_equals_hf(path, folder, hf_q, quantization="gguf")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer):
    """arch -> the tiny checkpoint's folder and HF's model of it, each made once."""
    from transformers import Phi3ForCausalLM

    made = {}

    def get(arch: str):
        if arch not in made:
            folder = str(tmp_path_factory.mktemp(arch))
            write_tiny_checkpoint(arch, folder, smollm2_tokenizer)
            hf = Phi3ForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            made[arch] = folder, hf
        return made[arch]

    return get


# phi3: a window of 12, default RoPE; phi3-longrope: no window (0 in the file), LongRoPE
# factors as tensors; phi4-mini: LongRoPE on 12 of 16 dimensions (rope.dimension_count).
@pytest.mark.parametrize("arch", ["phi3", "phi3-longrope", "phi4-mini"])
def test_phi3_gguf_config_weights_and_greedy_outputs(tmp_path, checkpoints, arch):
    folder, hf = checkpoints(arch)
    path = str(tmp_path / f"{arch}.gguf")
    write_phi3_gguf(path, hf.config, hf.state_dict())
    if arch != "phi3":
        factors = read_gguf_header(path).tensor_shapes["rope_factors_long.weight"]
        assert factors == ((6,) if arch == "phi4-mini" else (8,))

    config = load_hf_config(path)
    assert config.architectures == ["Phi3ForCausalLM"]
    assert config.model_type == "phi3"
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "original_max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "sliding_window",
        "tie_word_embeddings",
    ):
        assert getattr(config, field) == getattr(hf.config, field), field
    assert config.head_dim == 16  # hidden / heads: from the fused rows, no key_length

    weights = dict(iter_weights(path, torch.float32))
    state = hf.state_dict()
    tied = {"lm_head.weight"} if hf.config.tie_word_embeddings else set()
    assert set(weights) == set(state) - tied  # the fused names, as HF's checkpoint has them
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name

    assert_greedy_equals_hf(path, folder, hf, quantization="none")


@pytest.mark.skipif(gguf_kernels.load_gguf_kernels() is None, reason="no C compiler")
def test_quantized_phi3_gguf_keeps_blocks_and_gives_hf_greedy_outputs(
    tmp_path, checkpoints, monkeypatch
):
    """Quantized fused matrices stay GGUF blocks, cut into q/k/v and gate/up by rows; with
    the float32 kernel the outputs are HF's on the file's (dequantized) weights."""
    from transformers import Phi3ForCausalLM

    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")
    folder, hf = checkpoints("phi3")
    path = str(tmp_path / "phi3-q.gguf")
    qtypes = {"attn_qkv": "Q8_0", "ffn_up": "Q4_0", "attn_output": "Q5_0", "ffn_down": "Q8_0"}
    held = write_phi3_gguf(path, hf.config, hf.state_dict(), qtypes)
    hf_q = Phi3ForCausalLM(hf.config).eval()
    hf_q.load_state_dict(held)

    # Each fused matrix is held as the file's blocks, its shards one segment each.
    config = load_hf_config(path)
    backend = get_platform("cpu").create_attn_backend(16)
    model = resolve_model_class(config)(config, backend, quant_config=GGUFConfig())
    model.load_weights(iter_weights(path, torch.float32, "gguf"))
    layer = model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
    assert qkv.numel() == gate_up.numel() == 0  # no float copy
    assert [(row, t.qtype, t.shape) for row, t in qkv.quantized.segments] == [
        (0, Q8_0, (64, 64)),
        (64, Q8_0, (32, 64)),
        (96, Q8_0, (32, 64)),
    ]
    assert [(row, t.qtype) for row, t in gate_up.quantized.segments] == [(0, Q4_0), (128, Q4_0)]

    assert_greedy_equals_hf(path, folder, hf_q, quantization="gguf")
    # The reference is not the original model: the quantization changes its outputs.
    ids = torch.tensor([[1, 5, 9, 42, 7, 100]])
    with torch.no_grad():
        assert not torch.allclose(hf(ids).logits, hf_q(ids).logits, atol=1e-3)
