"""vLLM's sleep mode at level 1 for the KV cache (a many-model server's doze): the engine core
drops its KV cache and keeps its weights; a wake_up or the next request binds a new one, and
the engine answers as before (captured CPU graphs are captured again on the new cache)."""

from __future__ import annotations

import asyncio

import pytest

from minivllm import AsyncEngineArgs, AsyncLLM, SamplingParams

KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=tiny_llama, max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
    )
    yield engine
    engine.shutdown()


async def _greedy(engine: AsyncLLM, request_id: str, prompts=("The three primary colors are",)):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def one(i: int, prompt: str):
        outputs = [o async for o in engine.generate(prompt, params, f"{request_id}-{i}")]
        return outputs[-1].outputs[0].token_ids

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_sleep_drops_the_kv_cache_and_a_request_wakes_it(engine):
    prompts = ("The three primary colors are", "Once upon a time", "def fib(n):")

    async def main():
        before = await _greedy(engine, "before", prompts)
        freed = await engine.sleep()
        assert await engine.is_sleeping()
        after_request = await _greedy(engine, "after-request", prompts)  # wakes it
        assert not await engine.is_sleeping()
        await engine.sleep()
        await engine.wake_up()
        assert not await engine.is_sleeping()
        after_wake = await _greedy(engine, "after-wake", prompts)
        return freed, before, after_request, after_wake

    freed, before, after_request, after_wake = asyncio.run(main())
    assert KV_BYTES * 0.9 <= freed <= KV_BYTES
    assert after_request == before and after_wake == before


def test_sleep_is_refused_while_requests_run(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = engine.generate("Count to a hundred:", params, "long")
        await stream.__anext__()  # it runs
        with pytest.raises(RuntimeError, match="cannot sleep while requests run"):
            await engine.sleep()
        await stream.aclose()

    asyncio.run(main())


def test_sleep_cycles_keep_the_disk_cache_and_start_no_thread(tiny_llama, tmp_path):
    """With the disk prefix cache, its copier outlives a sleep (no new thread per wake) and
    a prompt's blocks written before a sleep are read back after it."""
    import psutil

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=tiny_llama,
            max_model_len=256,
            kv_cache_memory_bytes=KV_BYTES,
            kv_cache_disk=str(tmp_path / "kv"),
        )
    )
    prompt = ("The three primary colors are red, green and blue. " * 6,)
    try:

        async def main():
            first = await _greedy(engine, "first", prompt)
            core = psutil.Process(engine.engine_core.engine_pid)
            threads = core.num_threads()
            for i in range(3):
                await engine.sleep()
                await engine.wake_up()
                assert await _greedy(engine, f"again-{i}", prompt) == first
            stats = await engine.get_stats()
            return threads, core.num_threads(), stats

        before, after, stats = asyncio.run(main())
        assert after <= before
        assert stats.external_prefix_cache_hits > 0  # read back from disk after a sleep
    finally:
        engine.shutdown()


@pytest.mark.parametrize("multiprocessing", [False, True])
def test_llm_engine_sleeps_and_wakes_in_or_out_of_process(tiny_llama, multiprocessing):
    from minivllm import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=tiny_llama, max_model_len=256, kv_cache_memory_bytes=KV_BYTES,
                   enable_multiprocessing=multiprocessing)
    )  # fmt: skip
    try:
        assert engine.sleep() > 0 and engine.is_sleeping()
        assert engine.sleep() == 0  # asleep already
        engine.wake_up()
        assert not engine.is_sleeping()
    finally:
        engine.shutdown()
