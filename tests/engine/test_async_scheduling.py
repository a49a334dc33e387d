"""Async scheduling end to end: the engine core launches step N+1 before it collects step
N, and the outputs are the synchronous engine's, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.engine.core import EngineCore
from minivllm.engine.create_config import create_vllm_config

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a poem about the sea:",
    "1, 1, 2, 3, 5,",
    "The capital of France is a city that",  # shares a prefix with the second
]


def params(**kwargs) -> list[SamplingParams]:
    """Mixed lengths, so requests finish at different steps; one stops on EOS when it may."""
    return [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=i != 1, logprobs=2, **kwargs)
        for i, n in enumerate((24, 40, 7, 31, 1))
    ]


def generate(model: str, sampling: list[SamplingParams], **kwargs) -> list[tuple]:
    kwargs.setdefault("max_model_len", 256)
    llm = LLM(model, enable_multiprocessing=False, seed=0, **kwargs)
    outputs = llm.generate(PROMPTS, sampling, use_tqdm=False)
    generate.num_preemptions = llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].finish_reason,
            [sorted(lp) for lp in o.outputs[0].logprobs or []],
        )
        for o in outputs
    ]


def kv_bytes_per_token(model: str) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


@pytest.fixture
def launches(monkeypatch) -> list[bool]:
    """For each step launched: whether another was in flight (not yet collected)."""
    seen = []
    launch = EngineCore._launch

    def spy(self):
        seen.append(self.in_flight is not None)
        return launch(self)

    monkeypatch.setattr(EngineCore, "_launch", spy)
    return seen


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"max_num_batched_tokens": 8},  # chunked prefill
        {"kv_cache_tokens": 80, "block_size": 4, "max_model_len": 64},  # preemption
        {"max_num_seqs": 2},  # requests wait for a free slot
    ],
    ids=["plain", "chunked", "preempted", "waiting"],
)
def test_outputs_equal_the_synchronous_engine(tiny_model, engine, launches):
    engine = dict(engine)
    if "kv_cache_tokens" in engine:  # room for 80 tokens: the 5 requests need ~190
        engine["kv_cache_memory_bytes"] = engine.pop("kv_cache_tokens") * kv_bytes_per_token(
            tiny_model
        )
    expected = generate(tiny_model, params(), **engine)
    assert launches and not any(launches)  # the synchronous engine never launches ahead
    launches.clear()
    assert generate(tiny_model, params(), async_scheduling=True, **engine) == expected
    if "kv_cache_memory_bytes" in engine:
        assert generate.num_preemptions > 0
    assert sum(launches) > len(launches) // 2, "most steps launched with one in flight"


def test_a_request_with_penalties_makes_the_steps_wait(tiny_model, launches):
    sampling = params()
    sampling[2] = SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3)
    expected = generate(tiny_model, sampling)
    assert generate(tiny_model, sampling, async_scheduling=True) == expected
    # None launched ahead while the penalized request ran; the others, after it, did.
    assert not all(launches) and any(launches)


@pytest.mark.parametrize("preempted", [False, True], ids=["plain", "preempted"])
def test_seeded_sampling_draws_the_same_tokens(tiny_model, preempted, launches):
    """Preempted: requests lose their blocks with a token in flight, which is dropped and
    drawn again once they resume (from the generator as it was before that draw)."""
    sampling = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    engine = {}
    if preempted:
        engine = {"kv_cache_memory_bytes": 80 * kv_bytes_per_token(tiny_model)}
        engine |= {"block_size": 4, "max_model_len": 64}  # room for 80 of ~150 tokens
    expected = generate(tiny_model, sampling, **engine)
    launches.clear()
    assert generate(tiny_model, sampling, async_scheduling=True, **engine) == expected
    assert sum(launches) > len(launches) // 2, "most steps launched with one in flight"
    if preempted:
        assert generate.num_preemptions > 0


def test_the_bundled_model_in_the_engine_process_gives_the_same_text(smollm2_path):
    sampling = SamplingParams(temperature=0, max_tokens=48)

    def texts(**kwargs) -> list[str]:
        llm = LLM(smollm2_path, max_model_len=512, **kwargs)
        try:
            return [o.outputs[0].text for o in llm.generate(PROMPTS, sampling, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()

    assert texts(async_scheduling=True) == texts()


def test_async_scheduling_takes_one_worker(tiny_model):
    with pytest.raises(ValueError, match="async_scheduling runs one worker"):
        create_vllm_config(
            EngineArgs(model=tiny_model, async_scheduling=True, tensor_parallel_size=2)
        )


def test_streams_cancelled_and_constrained_midway_leave_the_others_alone(smollm2_path):
    """AsyncLLM (the engine core in its own process): one stream is cancelled while steps
    are in flight, a regex-constrained request joins midway (steps wait while it runs),
    and every other stream gives the synchronous engine's tokens; the KV cache is whole."""
    import asyncio
    import re

    from minivllm import AsyncEngineArgs, AsyncLLM
    from minivllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(smollm2_path, max_model_len=256)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm.llm_engine.shutdown()

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=smollm2_path, max_model_len=256, async_scheduling=True)
    )

    async def collect(prompt: str, params: SamplingParams, request_id: str):
        return [out async for out in engine.generate(prompt, params, request_id)]

    async def cancelled(started: asyncio.Event):
        delta = SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        async for out in engine.generate("Count slowly:", delta, "long"):
            if out.outputs[0].token_ids:
                started.set()
        raise AssertionError("the long stream should have been cancelled")

    async def main():
        idle = await engine.get_stats()
        started = asyncio.Event()
        long_task = asyncio.create_task(cancelled(started))
        streams = [
            asyncio.create_task(collect(p, greedy, f"story-{i}")) for i, p in enumerate(prompts)
        ]
        await started.wait()
        regex = SamplingParams(
            temperature=0,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[0-9]{4}"),
        )
        constrained = asyncio.create_task(collect("My phone number is", regex, "regex"))
        long_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long_task
        outputs = await asyncio.gather(*streams)
        phone = await constrained
        await asyncio.sleep(0.2)  # the step in flight for the cancelled stream is collected
        return idle, outputs, phone, await engine.get_stats()

    try:
        idle, outputs, phone, after = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [o[-1].outputs[0].token_ids for o in outputs] == expected
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", phone[-1].outputs[0].text)
    assert after.num_running_reqs == 0 and after.num_free_blocks == idle.num_free_blocks
