"""Data parallelism with engine core processes: two replicas give one's greedy tokens,
requests that share a prefix meet on one replica, and a replica killed under load fails
only its own requests, at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from minivllm import LLM, AsyncEngineArgs, AsyncLLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a poem about the sea:",
    "1, 1, 2, 3, 5,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def one_core(tiny_llama_dp) -> list[list[int]]:
    llm = LLM(tiny_llama_dp, seed=0, max_model_len=256)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def tiny_llama_dp(tmp_path_factory, smollm2_tokenizer) -> str:
    from tests.conftest import write_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny-llama-dp")
    return write_tiny_checkpoint(
        "llama", str(folder), smollm2_tokenizer, max_position_embeddings=2048
    )


def test_two_cores_give_one_cores_tokens_and_share_prefixes(tiny_llama_dp, one_core):
    llm = LLM(tiny_llama_dp, seed=0, max_model_len=256, data_parallel_size=2, block_size=16)
    client = llm.llm_engine.engine_core
    try:
        assert len(set(client.engine_pids)) == 2
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == one_core
        # Two families of prompts, each a 48-token prefix (3 blocks) and a user's line:
        # each family meets on one core, whose prefix cache then serves its prefix.
        tokenizer = llm.get_tokenizer()
        prefixes = [list(range(1000, 1048)), list(range(2000, 2048))]
        prompts = [
            {"prompt_token_ids": prefixes[i % 2] + tokenizer.encode(f" user {i} says hi")}
            for i in range(8)
        ]
        before = client.get_engine_stats()
        for prompt in prompts:  # one at a time: each finds the cache its family filled
            llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
        after = client.get_engine_stats()
    finally:
        llm.llm_engine.shutdown()
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before)]
    queries = [a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before)]
    assert sum(hits) == 2 * 3 * 48  # every request after its family's first hits 48 tokens
    assert all(q > 0 for q in queries)  # each family on its own core


@pytest.mark.slow  # two cores serve four 1,500-token requests
def test_a_killed_core_fails_only_its_requests(tiny_llama_dp):
    """Core 1's process SIGKILLed under load: only its requests fail, within 2 s."""

    async def run() -> tuple[list, list[int]]:
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(model=tiny_llama_dp, max_model_len=2048, data_parallel_size=2)
        )
        try:
            return await lose_replica_1(engine, signal.SIGKILL)
        finally:
            engine.shutdown()

    assert_only_replica_1_failed(*asyncio.run(run()))


async def lose_replica_1(engine, sig: int) -> tuple[list[tuple[str, float]], list[int]]:
    """Four long requests (two a replica: their prompts share no block, so the least
    loaded replica takes each); once all have started, replica 1's engine core (its
    process, or its Ray actor) gets ``sig``.
    Each request's finish reason and seconds from the signal to its end; the dead
    replicas."""
    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    ends: dict[str, tuple[str, float]] = {}
    started = asyncio.Event()

    async def follow(i: int) -> None:
        async for out in engine.generate(PROMPTS[i], long, request_id=f"r{i}"):
            ends.setdefault(f"started {i}", ("", 0.0))
            if sum(k.startswith("started") for k in ends) == len(PROMPTS):
                started.set()
            if out.finished:
                ends[f"r{i}"] = (out.outputs[0].finish_reason, time.monotonic())

    tasks = [asyncio.create_task(follow(i)) for i in range(len(PROMPTS))]
    await asyncio.wait_for(started.wait(), 120)
    signalled_at = time.monotonic()
    os.kill(engine.engine_core.engine_pids[1], sig)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)  # a replica never dropped: fail
    finished = [ends[f"r{i}"] for i in range(len(PROMPTS))]
    return [(reason, at - signalled_at) for reason, at in finished], engine.dead_engines()


def assert_only_replica_1_failed(ends: list, dead: list[int]) -> None:
    assert dead == [1]
    assert sorted(reason for reason, _ in ends) == ["error", "error", "length", "length"]
    assert all(after < 2.0 for reason, after in ends if reason == "error"), ends
