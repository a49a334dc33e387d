"""Greedy token ids equal those recorded before the model-side seams were cut (issue #14).

The ids in golden_ids.json come from the code as it was before platforms, the shared
Attention layer, LinearMethod, the split loader and InputBatch: any change of behaviour
on the bundled model or a tiny checkpoint shows up here. The batch mixes prompts of
different lengths, a shared prefix (prefix-cache hits) and a small token budget (chunked
prefills beside one-token rows). To re-record on purpose: MINIVLLM_RECORD_GOLDEN=1.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from minivllm import LLM, SamplingParams

GOLDEN = pathlib.Path(__file__).with_name("golden_ids.json")
MAX_NEW = 24
PREFIX = "You are a helpful assistant. Answer briefly and precisely. "
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):\n",
    PREFIX + "What is the largest planet?",
    PREFIX + "Name a prime number larger than ten.",
    "1, 2, 3, 4,",
]


def greedy_ids(model: str | None) -> list[list[int]]:
    # quantization="none": the bundled GGUF dequantized to float32, as HF's (the recorded ids)
    kwargs = dict(
        max_model_len=256,
        max_num_batched_tokens=32,
        enable_multiprocessing=False,
        quantization="none",
    )
    llm = LLM(model, **kwargs) if model else LLM(**kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def check(key: str, ids: list[list[int]]) -> None:
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("MINIVLLM_RECORD_GOLDEN") == "1":
        golden[key] = ids
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(golden.items())]
        GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")
        return
    assert ids == golden[key]


def test_bundled_model_keeps_its_ids():
    check("smollm2", greedy_ids(None))


def test_tiny_models_keep_their_ids(tiny_model):
    arch = json.loads((pathlib.Path(tiny_model) / "config.json").read_text())["model_type"]
    check(f"tiny-{arch}", greedy_ids(tiny_model))


@pytest.mark.parametrize("batch", [1, 3])
def test_small_batches_keep_their_ids(batch):
    """One to three sequences: the small-batch linear kernel's range."""
    llm = LLM(max_model_len=256, enable_multiprocessing=False, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:batch], params, use_tqdm=False)
    check(f"smollm2-batch{batch}", [out.outputs[0].token_ids for out in outputs])
