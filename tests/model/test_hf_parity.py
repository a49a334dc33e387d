"""Greedy outputs equal HF transformers token for token, on the real model and tiny ones."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

MAX_NEW = 64

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def quicksort(arr):\n",
    "import numpy as np\n\n# compute the mean of a list\n",
    "中国的首都是",
    "请用一句话介绍你自己。",
    "I love pizza 🍕 and",
    "Once upon a time, in a land far away,",
    "1, 1, 2, 3, 5, 8,",
]


def hf_greedy(model, prompt_ids: list[int], max_new: int, eos_token_id) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


# The speed switches (BENCHMARKS.md): none of them may change a greedy output.
SWITCHES = {
    "defaults": {},
    "switches off": {
        "MINIVLLM_CPU_PACKED_LINEAR": "0",
        "MINIVLLM_CPU_SMALL_BATCH_LINEAR": "0",
        "MINIVLLM_CPU_ATTN_KERNEL": "0",
        "MINIVLLM_CPU_LAYER_KERNELS": "0",
        "MINIVLLM_CPU_GRAPHS": "0",
        "MINIVLLM_CPU_REUSE_FREED_MEMORY": "0",
    },
}


@pytest.fixture(params=list(SWITCHES))
def switches(request):
    with pytest.MonkeyPatch.context() as mp:
        for name, value in SWITCHES[request.param].items():
            mp.setenv(name, value)
        yield request.param


@pytest.fixture(scope="module")
def smollm2_expected(smollm2_hf, smollm2_tokenizer):
    """HF's greedy continuations, computed once for every switch setting."""
    tokenizer = smollm2_tokenizer
    return {
        prompt: hf_greedy(smollm2_hf, tokenizer.encode(prompt), MAX_NEW, tokenizer.eos_token_id)
        for prompt in PROMPTS
    }


def test_smollm2_matches_transformers(switches, smollm2_expected):
    llm = LLM(max_model_len=512, quantization="none")  # int8 activations are not HF-exact
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        assert output.outputs[0].token_ids == smollm2_expected[prompt], prompt


TINY_PROMPTS = PROMPTS[:4]


@pytest.fixture(scope="module")
def tiny_expected(tiny_model):
    """HF's greedy continuations of one tiny checkpoint, computed once for every switch
    setting (the HF side does not read the switches): module-scoped on the session-scoped
    checkpoint, so each architecture is loaded and run by transformers once."""
    import transformers

    from minivllm.tokenizer import load_tokenizer

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tokenizer = load_tokenizer(tiny_model)
    # HF gets an eos id it can never produce (our side ignores eos).
    return {
        prompt: hf_greedy(hf.eval(), tokenizer.encode(prompt), MAX_NEW, eos_token_id=-1)
        for prompt in TINY_PROMPTS
    }


def test_tiny_models_match_transformers(tiny_model, switches, tiny_expected):
    llm = LLM(tiny_model, max_model_len=256)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(TINY_PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(TINY_PROMPTS, outputs):
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        assert output.outputs[0].token_ids == tiny_expected[prompt], prompt
