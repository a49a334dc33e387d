"""AsyncLLM.encode on a pooling engine: concurrent embeddings, abort, the wrong params."""

from __future__ import annotations

import asyncio

import pytest

from minivllm import LLM, AsyncEngineArgs, AsyncLLM, PoolingParams, SamplingParams

PROMPTS = [f"Sentence number {i} is about {'cats ' * i}and nothing else." for i in range(12)]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    args = AsyncEngineArgs(
        tiny_llama, runner="pooling", max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 24
    )
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    engine.shutdown()


def test_concurrent_encodes_equal_offline_embeddings(engine, tiny_llama):
    async def one(i: int):
        return [out async for out in engine.encode(PROMPTS[i], PoolingParams(), f"e{i}")]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    streams = asyncio.run(main())
    offline = LLM(tiny_llama, runner="pooling", enable_multiprocessing=False)
    expected = offline.embed(PROMPTS, use_tqdm=False)
    for outputs, reference in zip(streams, expected):
        assert len(outputs) == 1 and outputs[0].finished and outputs[0].finish_reason == "stop"
        assert outputs[0].outputs.data.tolist() == pytest.approx(
            reference.outputs.embedding, abs=1e-5
        )


def test_abort_ends_an_encode_in_flight_and_frees_its_blocks(engine):
    long_prompt = "word " * 480  # 30 steps of 16 tokens

    async def main():
        idle = await engine.get_stats()
        stream = engine.encode(long_prompt, PoolingParams(), "to-abort")
        task = asyncio.create_task(anext(stream))
        while (await engine.get_stats()).num_running_reqs == 0:
            await asyncio.sleep(0.01)
        await engine.abort("to-abort")
        output = await task
        return idle, output, await engine.get_stats()

    idle, output, after = asyncio.run(main())
    assert output.finished and output.finish_reason == "abort"
    assert output.outputs.data.numel() == 0
    assert after.num_running_reqs == 0 and after.num_free_blocks == idle.num_free_blocks


def test_sampling_params_on_a_pooling_engine_are_refused_and_it_serves_on(engine):
    async def main():
        with pytest.raises(ValueError, match="runner='generate'"):
            async for _ in engine.generate("hi", SamplingParams(max_tokens=2), "g"):
                pass
        return [out async for out in engine.encode("hi", PoolingParams(), "after")]

    (output,) = asyncio.run(main())
    assert output.finish_reason == "stop" and output.outputs.data.numel() == 64
