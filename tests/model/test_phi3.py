"""Phi-3 and Mistral from HF directories: the fused checkpoint tensors and the sliding window.

test_hf_parity_archs runs both tiny models in chunked prefill; here the prompts share a
prefix, so the later ones start from KV blocks cached by the first, and the windows (12 and
8 tokens) are shorter than the shared part: what a cached block holds must be what the
window would have computed.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.layers.rotary import RotaryEmbedding, rope_parameters
from minivllm.model.loader import load_hf_config
from minivllm.model.models.llama import MistralForCausalLM, Qwen2ForCausalLM
from minivllm.model.models.phi3 import Phi3ForCausalLM
from minivllm.model.registry import resolve_model_class
from tests.conftest import write_tiny_checkpoint
from tests.model.test_hf_parity_archs import hf_greedy_with_logprobs

INSTRUCTION = (
    "You are a careful assistant. Answer every question briefly and precisely, in one "
    "plain sentence, with no preamble, no lists and no apologies."
)
PROMPTS = [
    f"{INSTRUCTION} Question: What is the capital of France?",
    f"{INSTRUCTION} Question: Why is the sky blue?",
    f"{INSTRUCTION} Question: Who wrote Hamlet?",
]
MAX_NEW = 24


@pytest.fixture(scope="module", params=["phi3", "mistral"])
def windowed_model(request, tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return write_tiny_checkpoint(request.param, str(folder), smollm2_tokenizer)


def test_registry_and_window(windowed_model):
    config = load_hf_config(windowed_model)
    cls = resolve_model_class(config)
    assert cls is {"phi3": Phi3ForCausalLM, "mistral": MistralForCausalLM}[config.model_type]
    assert cls.uses_sliding_window
    assert not Qwen2ForCausalLM.uses_sliding_window  # Qwen2 configs name an unused window


def test_prefix_cache_hits_keep_hf_greedy_outputs(windowed_model):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        windowed_model, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    llm = LLM(
        windowed_model,
        max_model_len=128,
        block_size=16,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        enable_multiprocessing=False,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    # One prompt first, so that the others find its blocks cached.
    outputs = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    outputs += llm.generate(PROMPTS[1:], params, use_tqdm=False)
    assert llm.llm_engine.last_stats.prefix_cache_hits >= 2 * 16
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert len(output.prompt_token_ids) > 32  # the shared part spans two blocks
        tokens, logprobs = hf_greedy_with_logprobs(hf, output.prompt_token_ids, MAX_NEW)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, prompt
        ours = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        assert ours == pytest.approx(logprobs, abs=1e-4), prompt


def test_longrope_tables_equal_hf(tmp_path, smollm2_tokenizer):
    """Short factors inside the trained context (80 positions), long ones past it, both
    times the attention factor: HF's cos/sin for a sequence inside it and one past it."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    folder = write_tiny_checkpoint("phi3-longrope", str(tmp_path), smollm2_tokenizer)
    config = load_hf_config(folder)
    ours = RotaryEmbedding(16, 512, rope_parameters(config), torch.float32)
    assert ours.num_positions == 512
    theirs = Phi3RotaryEmbedding(config)
    x = torch.zeros(1)
    short_cos, short_sin = (t[0] for t in theirs(x, torch.arange(80)[None]))
    long_cos, long_sin = (t[0] for t in theirs(x, torch.arange(512)[None]))
    torch.testing.assert_close(ours.cos[:80], short_cos, atol=0, rtol=0)
    torch.testing.assert_close(ours.sin[:80], short_sin, atol=0, rtol=0)
    torch.testing.assert_close(ours.cos[80:], long_cos[80:], atol=0, rtol=0)
    torch.testing.assert_close(ours.sin[80:], long_sin[80:], atol=0, rtol=0)
    assert (short_cos - long_cos[:80]).abs().max() > 0.1  # the two sets differ


def test_fused_tensors_shard_by_heads_and_rows_on_each_rank(tmp_path, smollm2_tokenizer):
    """Two ranks: each holds its two query heads, its KV head and its half of gate and of
    up, cut from the checkpoint's fused tensors."""
    from minivllm.distributed.parallel_state import TPGroup
    from minivllm.model.loader import iter_weights
    from minivllm.platforms import get_platform

    folder = write_tiny_checkpoint("phi3", str(tmp_path), smollm2_tokenizer)
    config = load_hf_config(folder)
    state = dict(iter_weights(folder, torch.float32))
    qkv = state["model.layers.1.self_attn.qkv_proj.weight"]
    gate_up = state["model.layers.1.mlp.gate_up_proj.weight"]
    q, k, v = qkv.split([64, 32, 32])  # 4 query heads, 2 KV heads of 16
    gate, up = gate_up.chunk(2)
    backend = get_platform("cpu").create_attn_backend(16)
    for rank in range(2):
        model = Phi3ForCausalLM(config, backend, TPGroup(rank=rank, size=2))
        model.load_weights(iter_weights(folder, torch.float32))
        layer = model.model.layers[1]
        expected_qkv = torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]])
        assert torch.equal(layer.self_attn.qkv_proj.weight, expected_qkv)
        expected_gate_up = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, expected_gate_up)


def test_two_ranks_give_hf_greedy_outputs(windowed_model):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        windowed_model, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    llm = LLM(windowed_model, max_model_len=128, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for prompt, output in zip(PROMPTS, outputs):
        tokens, _ = hf_greedy_with_logprobs(hf, output.prompt_token_ids, MAX_NEW)
        assert output.outputs[0].token_ids == tokens, prompt
