"""Prefix caching and preemption on the bundled model: greedy outputs never change."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams

BLOCK_SIZE = 16
# SmolLM2-135M in fp32: 30 layers x (K and V) x 3 KV heads x 64 dims x 4 bytes per token.
BYTES_PER_BLOCK = 30 * 2 * 3 * 64 * 4 * BLOCK_SIZE
SMALL_POOL_BLOCKS = 16  # 256 tokens
MAX_MODEL_LEN = 128

INSTRUCTION = (
    "You are a careful assistant. Answer every question briefly and precisely, in one "
    "plain sentence, with no preamble, no lists and no apologies."
)
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Who wrote Hamlet?",
    "What is water made of?",
    "How many legs does a spider have?",
    "What does a thermometer measure?",
]
# 36 to 39 tokens each; the first 32 (two blocks) are the same.
SHARED_PREFIX = [f"{INSTRUCTION} Question: {q}" for q in QUESTIONS[:3]]
# Question first, so nothing is shared: 34 to 38 tokens each. With 16 outputs each
# grows to 4 blocks, and 6 x 4 > 16.
UNSHARED = [f"{q} {INSTRUCTION}" for q in QUESTIONS]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def make_llm(**kwargs) -> LLM:
    # quantization="none": a prefix read back from the cache changes attention's float sums
    # (by ~1e-7), which the int8 activations of the GGUF default can round into another
    # greedy token; the float32 weights keep the comparison with the reference exact.
    return LLM(
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        quantization="none",
        **kwargs,
    )


def generate(llm: LLM, prompts, **kwargs) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, **kwargs)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy outputs with prefix caching off and a pool that never preempts."""
    llm = make_llm(enable_prefix_caching=False, kv_cache_memory_bytes=64 * BYTES_PER_BLOCK)
    prompts = SHARED_PREFIX + UNSHARED
    outputs = dict(zip(prompts, generate(llm, prompts)))
    assert llm.llm_engine.last_stats.num_preemptions == 0
    assert llm.llm_engine.last_stats.prefix_cache_queries == 0
    llm.llm_engine.shutdown()
    return outputs


@pytest.fixture(scope="module")
def llm_small_pool():
    """Prefix caching on, a pool of 16 blocks, and the priority policy."""
    llm = make_llm(
        enable_prefix_caching=True,
        kv_cache_memory_bytes=SMALL_POOL_BLOCKS * BYTES_PER_BLOCK,
        scheduling_policy="priority",
    )
    yield llm
    llm.llm_engine.shutdown()


def counters(llm: LLM) -> tuple[int, int]:
    """(prefix cache hits in tokens, preemptions) so far."""
    stats = llm.llm_engine.last_stats
    return (0, 0) if stats is None else (stats.prefix_cache_hits, stats.num_preemptions)


def test_greedy_outputs_are_the_same_with_prefix_caching_on_and_off(reference, llm_small_pool):
    tokenizer = llm_small_pool.get_tokenizer()
    assert len(tokenizer.encode(f"{INSTRUCTION} Question:")) >= 2 * BLOCK_SIZE
    hits, preemptions = counters(llm_small_pool)
    assert generate(llm_small_pool, SHARED_PREFIX) == [reference[p] for p in SHARED_PREFIX]
    new_hits, new_preemptions = counters(llm_small_pool)
    assert new_hits - hits >= 2 * (2 * BLOCK_SIZE)  # the later two hit the shared blocks
    assert new_preemptions == preemptions, "this test wants no preemption"
    # Again: each prompt now hits its own earlier blocks, and nothing changes.
    assert generate(llm_small_pool, SHARED_PREFIX) == [reference[p] for p in SHARED_PREFIX]
    assert counters(llm_small_pool)[0] > new_hits


def test_greedy_outputs_are_the_same_when_the_pool_forces_preemption(reference, llm_small_pool):
    _, preemptions = counters(llm_small_pool)
    outputs = generate(llm_small_pool, UNSHARED, priority=[3, 0, 2, 1, 0, 3])
    assert counters(llm_small_pool)[1] > preemptions, "the small pool should have preempted"
    assert outputs == [reference[p] for p in UNSHARED]


def test_an_aborted_request_gives_its_blocks_back(llm_small_pool):
    engine = llm_small_pool.llm_engine
    engine.add_request(
        "to-abort", UNSHARED[0], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    )
    while not engine.step():  # until its prompt is computed and it holds blocks
        pass
    assert engine.last_stats.num_free_blocks < SMALL_POOL_BLOCKS
    engine.abort_request("to-abort")
    # The next request to finish reports the pool as its last step left it: all free.
    (output,) = llm_small_pool.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert output.finished
    assert engine.last_stats.num_free_blocks == SMALL_POOL_BLOCKS
    assert engine.last_stats.num_running_reqs == 0


def test_a_cache_salt_keeps_its_blocks_to_the_requests_that_carry_it(llm_small_pool):
    """vLLM's cache_salt: a salted prompt hits only the blocks of its own salt, never the
    unsalted ones nor another salt's (a shared server's tenants cannot time each other's)."""
    prompt = f"{INSTRUCTION} Question: {QUESTIONS[4]}"

    def run(salt=None) -> tuple[list[int], int]:
        item = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        (output,) = llm_small_pool.generate([item], GREEDY, use_tqdm=False)
        return output.outputs[0].token_ids, output.num_cached_tokens

    plain, _ = run()
    assert run()[1] >= 2 * BLOCK_SIZE  # unsalted: the same prompt hits its blocks
    for salt in ("tenant-a", "tenant-b"):
        assert run(salt) == (plain, 0)  # neither the unsalted blocks nor the other salt's
    assert run("tenant-a")[1] >= 2 * BLOCK_SIZE
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm_small_pool.generate([{"prompt": prompt, "cache_salt": ""}], GREEDY)
