"""AsyncLLM on the bundled model: output kinds, concurrent streams, cancellation, abort."""

from __future__ import annotations

import asyncio

import pytest

from minivllm import AsyncEngineArgs, AsyncLLM, SamplingParams
from minivllm.sampling_params import RequestOutputKind
from tests import faults


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(max_model_len=256))
    yield engine
    engine.shutdown()


def params(kind=RequestOutputKind.CUMULATIVE, max_tokens=12, **kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind, **kwargs
    )


async def collect(engine: AsyncLLM, prompt: str, sampling_params, request_id: str) -> list:
    return [out async for out in engine.generate(prompt, sampling_params, request_id)]


def test_output_kinds_agree(engine):
    prompt = "The three primary colors are"

    async def main():
        return await asyncio.gather(
            collect(engine, prompt, params(RequestOutputKind.CUMULATIVE), "cumulative"),
            collect(engine, prompt, params(RequestOutputKind.DELTA), "delta"),
            collect(engine, prompt, params(RequestOutputKind.FINAL_ONLY), "final"),
        )

    cumulative, delta, final = asyncio.run(main())
    full = cumulative[-1].outputs[0]
    assert cumulative[-1].finished and len(full.token_ids) == 12
    # CUMULATIVE: each output extends the previous one.
    for before, after in zip(cumulative, cumulative[1:]):
        assert after.outputs[0].text.startswith(before.outputs[0].text)
        assert after.outputs[0].token_ids[: len(before.outputs[0].token_ids)] == (
            before.outputs[0].token_ids
        )
    # DELTA: only what is new; the chunks add up to the cumulative text and tokens.
    assert len(delta) > 1 and delta[-1].finished and not any(o.finished for o in delta[:-1])
    assert "".join(o.outputs[0].text for o in delta) == full.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == full.token_ids
    # FINAL_ONLY: one output, the whole thing.
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].text == full.text
    assert final[0].outputs[0].finish_reason == "length"


def test_32_concurrent_streams_batch_and_finish(engine):
    prompts = [f"Story number {i}: once upon a time" for i in range(32)]
    lengths = [3 + i % 6 for i in range(32)]
    running_seen = []

    async def stream(i: int):
        count = 0
        async for out in engine.generate(
            prompts[i], params(RequestOutputKind.DELTA, lengths[i]), f"stream-{i}"
        ):
            count += len(out.outputs[0].token_ids)
            if engine.last_stats is not None:
                running_seen.append(engine.last_stats.num_running_reqs)
            last = out
        return count, last

    async def main():
        results = await asyncio.gather(*(stream(i) for i in range(32)))
        return results, await engine.get_stats()

    results, stats = asyncio.run(main())
    for (count, last), expected in zip(results, lengths):
        assert count == expected
        assert last.finished and last.outputs[0].finish_reason == "length"
    assert max(running_seen) > 16  # the streams were batched together in the core
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0


def test_cancelled_stream_is_aborted_and_frees_its_blocks(engine):
    async def long_stream(started: asyncio.Event):
        async for out in engine.generate(
            "Count slowly:", params(RequestOutputKind.DELTA, max_tokens=200), "long"
        ):
            if len(out.outputs[0].token_ids) and not started.is_set():
                started.set()
        raise AssertionError("the long stream should have been cancelled")

    async def main():
        idle = await engine.get_stats()
        started = asyncio.Event()
        long_task = asyncio.create_task(long_stream(started))
        others = [
            asyncio.create_task(collect(engine, f"Item {i}:", params(max_tokens=8), f"short-{i}"))
            for i in range(3)
        ]
        await started.wait()
        for _ in range(2):  # a few more steps with the long request running
            await asyncio.sleep(0.05)
        busy = await engine.get_stats()
        long_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long_task
        short = await asyncio.gather(*others)
        after = await engine.get_stats()
        return idle, busy, short, after

    idle, busy, short, after = asyncio.run(main())
    assert busy.num_free_blocks < idle.num_free_blocks
    for outputs in short:
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8
    # Without the abort the long request would still be running (200 tokens) here.
    assert after.num_running_reqs == 0 and after.num_waiting_reqs == 0
    assert after.num_free_blocks == idle.num_free_blocks
    assert not engine.output_processor.has_unfinished_requests()


def test_abort_ends_the_stream_with_an_abort_output(engine):
    async def main():
        outputs = []
        async for out in engine.generate(
            "Tell me everything:", params(RequestOutputKind.DELTA, max_tokens=200), "to-abort"
        ):
            outputs.append(out)
            if len(outputs) == 2:
                await engine.abort("to-abort")
        return outputs, await engine.get_stats()

    outputs, stats = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs) >= 3 and not any(o.finished for o in outputs[:-1])
    assert stats.num_running_reqs == 0


def test_parallel_sampling_streams(engine):
    async def main():
        return await collect(
            engine, "My favourite fruit is", params(RequestOutputKind.DELTA, 5, n=2), "n2"
        )

    outputs = asyncio.run(main())
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    tokens = {0: [], 1: []}
    for out in outputs:
        for completion in out.outputs:
            tokens[completion.index] += completion.token_ids
    assert len(tokens[0]) == len(tokens[1]) == 5 and tokens[0] == tokens[1]


def test_duplicate_request_id_and_bad_params_are_rejected(engine):
    async def main():
        gen = engine.generate("Hi", params(max_tokens=30), "dup")
        first = await gen.__anext__()
        with pytest.raises(ValueError, match="already running"):
            await collect(engine, "Hi", params(), "dup")
        await gen.aclose()  # closing early aborts
        with pytest.raises(ValueError):
            await collect(engine, "", params(), "empty")
        return first, await engine.get_stats()

    first, stats = asyncio.run(main())
    assert not first.finished
    assert stats.num_running_reqs == 0
    assert not engine.output_processor.has_unfinished_requests()


def test_a_request_the_client_cannot_send_leaves_nothing_behind(engine, monkeypatch):
    """One of n samples fails to reach the core (an encoder's error, say): generate raises,
    the sample already sent is aborted in the core too, and nothing stays followed."""
    add = engine.engine_core.add_request_async

    async def failing_add(request):
        if request.request_id == "1_unsendable":  # the second sample; the first was sent
            raise faults.InjectedFault("injected fault sending the request")
        return await add(request)

    monkeypatch.setattr(engine.engine_core, "add_request_async", failing_add)

    async def main():
        with pytest.raises(faults.InjectedFault):
            await collect(engine, "Hi", params(max_tokens=200, n=2), "unsendable")
        stats = await engine.get_stats()
        return stats, await collect(engine, "Hi", params(max_tokens=3), "next")

    stats, outputs = asyncio.run(main())
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
    assert not engine.output_processor.has_unfinished_requests()
