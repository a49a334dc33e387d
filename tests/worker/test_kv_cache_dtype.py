"""--kv-cache-dtype through the engine on the bundled model: an 8-bit cache holds >= 1.9x the
tokens of a float32 one in the same budget, int8 (float16 keys, int8 values) keeps the
float32 cache's greedy tokens, and its greedy outputs do not depend on CPU graphs, chunked
prefill, prefix-cache hits or preemption (each token's attention reads the same quantized
cache whichever way its prompt was computed)."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.attention.cpu import CPUAttentionBackend
from minivllm.attention.triton import TritonAttentionBackend


@pytest.mark.parametrize("backend_cls", [CPUAttentionBackend, TritonAttentionBackend])
@pytest.mark.parametrize(
    "name, row_bytes",
    # SmolLM2's shape (3 KV heads of 64): a float32 head row is 256 bytes; int8's key is
    # 128 (float16) and its value 68 (with the scale), as fp8's; int8k_int8v's rows 68,
    # e4m3k_e4m3v's 64.
    [
        ("int8", 98),
        ("fp16k_int8v", 98),
        ("fp8", 98),
        ("fp8_e5m2", 98),
        ("int8k_int8v", 68),
        ("e4m3k_e4m3v", 64),
    ],
)
def test_an_8_bit_cache_counts_its_real_bytes(backend_cls, name, row_bytes):
    import torch

    def block_bytes(backend) -> int:
        shape, dtype = backend.kv_cache_spec(1, 16, 3, 64, torch.float32)
        return shape[0] * shape[1] * shape[2] * shape[3] * shape[4] * dtype.itemsize

    plain = block_bytes(backend_cls(16))
    quantized = block_bytes(backend_cls(16, kv_cache_dtype=name))
    assert plain / quantized == pytest.approx(256 / row_bytes)
    assert plain / quantized >= 1.9


def _outputs(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_int8_cache_keeps_the_float32_caches_greedy_tokens():
    """The same engine with a float32 and an int8 cache: most prompts' 24 greedy tokens are
    the same (a near-tie may turn a token, and from there the rest: 7 of 8 were the same,
    the other turned at its second token; int8k_int8v, its keys smoothed, the same 7).
    Weights dequantized to float32: the GGUF kernels' int8 activations turn near-ties
    whatever the cache (even a float16 cache agrees on only ~97% of top-1 tokens there,
    BENCHMARKS.md)."""
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at a temperature of",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "To make a cup of tea, first",
        "import numpy as np\nx = np.",
        "The largest planet in the solar system is",
    ]
    common = dict(
        enable_multiprocessing=False,
        max_model_len=256,
        kv_cache_memory_bytes=16 << 20,
        quantization="none",
    )
    expected = _outputs(LLM(**common), prompts)
    for name in ("int8", "int8k_int8v"):
        got = _outputs(LLM(**common, kv_cache_dtype=name), prompts)
        same = sum(a == b for a, b in zip(got, expected, strict=True))
        assert same >= 6, (name, same, got, expected)


def _top1_over_a_text(**kwargs) -> list[int]:
    """Each position's most likely next token over ~600 tokens of README.md, read as one
    prompt (teacher-forced: every position sees the text, not the model's own tokens)."""
    import os

    llm = LLM(enable_multiprocessing=False, max_model_len=1024, quantization="none", **kwargs)
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    with open(readme) as f:
        ids = llm.get_tokenizer().encode(f.read())[:600]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return [next(t for t, lp in p.items() if lp.rank == 1) for p in out.prompt_logprobs[1:]]


@pytest.mark.slow  # ~30 s: three engines' prompts of 600 tokens
def test_8_bit_caches_agree_with_the_float32_caches_top_1_tokens():
    """Issue 53's measure on a short text: the top-1 token at each position with int8
    (float16 keys, int8 values) and fp8 (float16 keys, fp8 values scaled per row) agrees
    with the float32 cache's at >= 97% of positions (here 99.3% and 98.0%; BENCHMARKS.md:
    99.7% and 98.7% over 4,096 tokens; fp8 keys with scale 1 agreed on 95.5% over 20,480)."""
    common = dict(kv_cache_memory_bytes=64 << 20)
    expected = _top1_over_a_text(**common)
    for name in ("int8", "fp8"):
        got = _top1_over_a_text(kv_cache_dtype=name, **common)
        same = sum(a == b for a, b in zip(got, expected, strict=True)) / len(expected)
        assert same >= 0.97, (name, same)


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
    # CPU graphs, 64-token chunks, prefix caching, and a cache of 4 requests' worth (int8:
    # 30 layers x 3 heads x (128 + 68) bytes a token): requests are preempted.
    busy = LLM(
        **common,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=4 * 190 * 30 * 3 * 196 + (1 << 20),
    )
    assert _outputs(busy, prompts) == expected
    assert busy.llm_engine.engine_core.num_blocks < blocks_plain


def test_int8k_int8v_decode_steps_replay_as_cpu_graphs(monkeypatch):
    """Its keys' smoothing is a mul writing a new tensor for the query and one for the keys,
    which a CPU graph replays (a composite op would make every decode step refuse its graph
    and run eagerly)."""
    from tests.worker.test_cpu_graph import run

    replayed, graphs = run(monkeypatch, "1", "gguf", kv_cache_dtype="int8k_int8v")
    eager, _ = run(monkeypatch, "0", "gguf", kv_cache_dtype="int8k_int8v")
    assert replayed == eager
    assert sorted(size for size, graph in graphs.items() if graph is not None) == [1, 2, 3, 4, 5, 6]


def test_int8k_int8v_calibrates_its_key_factors_at_start_up():
    """Every attention layer gets its keys' factors from the start-up calibration
    (kv_smoothing.py): powers of two >= 1, some above 1 (SmolLM2's keys have channels far
    above their head's median), and the same in a second engine (seeded ids, no text: a
    cache's bytes are a function of the model)."""
    import torch

    def factors() -> list[torch.Tensor]:
        llm = LLM(
            enable_multiprocessing=False,
            max_model_len=256,
            kv_cache_memory_bytes=16 << 20,
            kv_cache_dtype="int8k_int8v",
        )
        worker = llm.llm_engine.engine_core.engine_core.executor.worker
        return [attn.key_factors for attn in worker.model.attention_layers()]

    first, second = factors(), factors()
    assert len(first) == 30 and all(f.shape == (3, 64) for f in first)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(f.min() >= 1 and torch.equal(f, torch.exp2(torch.log2(f).round())) for f in first)
    assert sum(int((f > 1).sum()) for f in first) > 0
