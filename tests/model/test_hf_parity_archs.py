"""OPT, Gemma 2 and 3, Qwen3-MoE, RoPE-scaled Llama: greedy tokens equal HF's, logprobs to 1e-4.

Each tiny checkpoint has a short trained context or sliding window (see tests/conftest.py),
and the generations run past it, so the scaled RoPE and the windowed layers are exercised
in prefill chunks and in decode steps alike.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.conftest import MOE_ARCHS, OTHER_ARCHS, ROPE_SCALED_ARCHS, write_tiny_checkpoint

MAX_NEW = 48
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "Once upon a time, in a land far away, there lived a",
]


@pytest.fixture(scope="module", params=[*ROPE_SCALED_ARCHS, *OTHER_ARCHS, *MOE_ARCHS])
def arch_model(request, tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return write_tiny_checkpoint(request.param, str(folder), smollm2_tokenizer)


def hf_greedy_with_logprobs(model, prompt_ids: list[int], max_new: int):
    """HF's greedy tokens and the log-probability of each."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=-1,  # never produced: always max_new tokens
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), dim=-1)[token].item()
        for step, token in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def assert_two_ranks_give_hf_greedy_outputs(folder: str, max_new: int = 24) -> None:
    """Two worker processes (tensor_parallel_size=2) give HF's greedy tokens on the first
    two prompts."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    llm = LLM(folder, max_model_len=128, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
        outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for prompt, output in zip(PROMPTS, outputs):
        tokens, _ = hf_greedy_with_logprobs(hf, output.prompt_token_ids, max_new)
        assert output.outputs[0].token_ids == tokens, prompt


def test_greedy_and_logprobs_match_transformers(arch_model):
    import transformers

    # Eager attention: HF's SDPA path would drop Gemma's attention-logit soft-capping.
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        arch_model, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # A small step budget cuts the longer prompts into chunks that start after earlier context.
    llm = LLM(
        arch_model,
        max_model_len=128,
        max_num_batched_tokens=16,
        enable_multiprocessing=False,
    )
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        assert output.prompt_token_ids == ids
        expected_tokens, expected_logprobs = hf_greedy_with_logprobs(hf, ids, MAX_NEW)
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens, prompt
        logprobs = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4), prompt
