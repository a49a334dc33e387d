"""Granite 4.0-H (Mamba-2 + attention, dense or with experts) against HF transformers' own
GraniteMoeHybrid classes on tiny random-weight checkpoints: greedy tokens equal and logprobs
within 1e-4, with prompts cut into odd-sized chunks (conv and SSM states carried across
them), batched together, and preempted and recomputed."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.model.test_lfm2 import hf_greedy_with_logprobs

LAYER_TYPES = ["mamba", "attention", "mamba", "attention", "mamba"]
PROMPTS = [
    "Hello, my name is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "Once upon a time, in a land far away, there lived a",
    "A",
]
MAX_NEW = 16


def write_tiny_granite_hybrid(folder: str, tokenizer, experts: int) -> str:
    import transformers

    config = transformers.GraniteMoeHybridConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=32,  # each expert's
        shared_intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        position_embedding_type="rope" if experts else None,
        num_local_experts=experts,
        num_experts_per_tok=2,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=16,  # HF's torch scan pads each pass to a chunk: keep them short
        rms_norm_eps=1e-6,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=1.5,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    torch.manual_seed(0)
    model = transformers.GraniteMoeHybridForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF starts norms at one: random ones prove they are loaded
                param.add_(torch.randn_like(param) * 0.2)
            if name.endswith(("dt_bias", ".D")):  # ones at the start
                param.add_(torch.randn_like(param) * 0.5)
            if "conv1d" in name:
                param.copy_(torch.randn_like(param) * 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(
    scope="module", params=[0, pytest.param(4, marks=pytest.mark.slow)], ids=["dense", "moe"]
)
def granite_case(request, tmp_path_factory, smollm2_tokenizer):
    folder = str(tmp_path_factory.mktemp(f"tiny-granite-h-{request.param}"))
    write_tiny_granite_hybrid(folder, smollm2_tokenizer, request.param)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = {}
    for prompt in PROMPTS:
        ids = smollm2_tokenizer.encode(prompt)
        expected[prompt] = hf_greedy_with_logprobs(hf, ids, MAX_NEW)
    return folder, expected


def generate(model: str, max_model_len: int = 128, **llm_kwargs):
    llm = LLM(model, max_model_len=max_model_len, enable_multiprocessing=False, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    return llm, llm.generate(PROMPTS, params, use_tqdm=False)


def assert_matches_hf(outputs, expected) -> None:
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        tokens, logprobs = expected[prompt]
        completion = output.outputs[0]
        assert completion.token_ids == tokens, prompt
        got = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        assert got == pytest.approx(logprobs, abs=1e-4), prompt


def test_chunked_batched_prompts_give_transformers_tokens(granite_case):
    folder, expected = granite_case
    llm, outputs = generate(folder, max_num_batched_tokens=7)
    assert_matches_hf(outputs, expected)
    worker = llm.llm_engine.engine_core.engine_core.executor.worker
    assert len(worker.state_layers()) == 3 and len(worker.model.attention_layers()) == 2


def test_preempted_requests_recompute_their_state(granite_case):
    folder, expected = granite_case
    # Attention: 2 layers x K and V x 2 heads x 16 floats = 512 bytes a token, 8 KiB a block
    # of 16. A state: 3 layers x (conv [96, 3] + SSM [4, 16, 8]) floats = 9600 bytes. Room
    # for 4 states and 7 blocks: one 64-token request fits, not the four prompts at once (9).
    state_bytes = 3 * (96 * 3 + 4 * 16 * 8) * 4
    llm, outputs = generate(
        folder,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=64,
        kv_cache_memory_bytes=7 * 8192 + 4 * state_bytes,
    )
    assert llm.llm_engine.engine_core.engine_core.executor.worker.num_state_slots == 4
    assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
    assert_matches_hf(outputs, expected)


def test_decode_steps_replay_as_cpu_graphs(monkeypatch, granite_case):
    from minivllm.kernels.cpu_kernels import load_kernels
    from minivllm.kernels.ssm_kernels import load_ssm_kernels

    if load_ssm_kernels() is None or load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None:
        pytest.skip("no C compiler")
    folder, expected = granite_case
    monkeypatch.setenv("MINIVLLM_CPU_GRAPHS", "1")
    llm, outputs = generate(folder)
    assert_matches_hf(outputs, expected)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    if runner.model.has_experts:
        return  # the experts are picked on the host: those steps run eagerly
    assert runner.cpu_graphs and all(g is not None for g in runner.cpu_graphs.values())
