"""Tensor parallelism over a quantized KV cache: each rank quantizes its own heads' rows, one
scale per token and head (int8k_int8v: after dividing its heads' key channels by the factors
each rank calibrates for its own heads, in one forward the ranks run together), so two ranks
over gloo give one rank's greedy tokens with the same --kv-cache-dtype."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "def quicksort(arr):\n", "1, 1, 2, 3, 5, 8,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "kv_cache_dtype", ["int8", "int8k_int8v", pytest.param("fp8", marks=pytest.mark.slow)]
)  # ~16 s each
def test_tp2_with_a_quantized_cache_gives_tp1s_tokens(tiny_llama_tp, kv_cache_dtype):
    one = LLM(
        tiny_llama_tp,
        max_model_len=256,
        enable_multiprocessing=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    one.llm_engine.shutdown()
    two = LLM(
        tiny_llama_tp, max_model_len=256, tensor_parallel_size=2, kv_cache_dtype=kv_cache_dtype
    )
    got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
    two.llm_engine.shutdown()
    assert got == expected
