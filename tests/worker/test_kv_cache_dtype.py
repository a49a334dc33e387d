"""--kv-cache-dtype through the engine on the bundled model: an 8-bit cache holds >= 1.9x the
tokens of a float32 one in the same budget, and its greedy outputs do not depend on CPU
graphs, chunked prefill, prefix-cache hits or preemption (each token's attention reads the
same quantized cache whichever way its prompt was computed)."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.attention.cpu import CPUAttentionBackend
from minivllm.attention.triton import TritonAttentionBackend


@pytest.mark.parametrize("backend_cls", [CPUAttentionBackend, TritonAttentionBackend])
@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e5m2"])
def test_an_8_bit_cache_counts_its_real_bytes(backend_cls, name):
    """SmolLM2's shape (3 KV heads of 64): float32 rows are 256 bytes, int8 rows 68 (with
    the scale), fp8 rows 64."""
    import torch

    def block_bytes(backend) -> int:
        shape, dtype = backend.kv_cache_spec(1, 16, 3, 64, torch.float32)
        return shape[0] * shape[1] * shape[2] * shape[3] * shape[4] * dtype.itemsize

    plain = block_bytes(backend_cls(16))
    quantized = block_bytes(backend_cls(16, kv_cache_dtype=name))
    assert plain / quantized == pytest.approx(256 / (68 if name == "int8" else 64))
    assert plain / quantized >= 1.9


def _outputs(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_int8_cache_outputs_are_the_same_with_every_feature():
    # Prompts that share a long prefix (prefix-cache hits) and are long enough to be chunked.
    base = "A story about a lighthouse keeper who finds a message in a bottle. " * 12
    prompts = [base + f"Chapter {i}: the" for i in range(6)]
    common = dict(kv_cache_dtype="int8", enable_multiprocessing=False, max_model_len=512)
    plain = LLM(
        **common,
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        kv_cache_memory_bytes=32 << 20,
    )
    expected = _outputs(plain, prompts)
    blocks_plain = plain.llm_engine.engine_core.num_blocks
    del plain
    # CPU graphs, 64-token chunks, prefix caching, and a cache of 4 requests' worth (int8
    # rows: 30 layers x 3 heads x 68 bytes x 2 a token): requests are preempted.
    busy = LLM(
        **common,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=4 * 190 * 30 * 3 * 68 * 2 + (1 << 20),
    )
    assert _outputs(busy, prompts) == expected
    assert busy.llm_engine.engine_core.num_blocks < blocks_plain
