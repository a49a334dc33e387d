"""Faults: a dead engine core makes every call fail fast; no engine process outlives us."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from minivllm import AsyncEngineArgs, AsyncLLM, EngineArgs, LLMEngine, SamplingParams
from minivllm.engine.exceptions import EngineDeadError
from minivllm.engine.messages import EngineCoreRequest
from tests.engine.conftest import engine_children, pid_alive, wait_gone

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
DEAD_WITHIN_S = 10.0


def make_engine(model: str) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=model, max_model_len=512, enable_multiprocessing=True)
    )


def step_until_error(engine: LLMEngine) -> BaseException:
    """Step in a worker thread, so that a hang fails the test instead of blocking it."""

    def loop():
        while True:
            engine.step()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(loop)
        try:
            future.result(timeout=DEAD_WITHIN_S)
        except concurrent.futures.TimeoutError:
            pytest.fail(f"step() still running {DEAD_WITHIN_S} s after the core died")
        except BaseException as exc:
            return exc
    raise AssertionError("unreachable")


def test_kill_9_makes_pending_steps_raise(tiny_llama, caplog):
    engine = make_engine(tiny_llama)
    pid = engine.engine_core.engine_pid
    for i in range(4):
        engine.add_request(str(i), f"Prompt {i}", LONG)
    engine.step()
    os.kill(pid, signal.SIGKILL)
    with caplog.at_level(logging.ERROR, logger="minivllm"):
        error = step_until_error(engine)
    assert isinstance(error, EngineDeadError)
    assert "SIGKILL" in str(error.__cause__)
    assert any("engine core died" in r.getMessage() for r in caplog.records)
    # Every later call fails fast too; aborting is a no-op; shutdown is clean.
    with pytest.raises(EngineDeadError):
        engine.add_request("late", "Hi", LONG)
    with pytest.raises(EngineDeadError):
        engine.get_stats()
    engine.abort_request(["0", "1"])
    engine.shutdown()
    assert wait_gone(pid, 5)


def test_exception_in_the_model_kills_the_core_and_is_reported(tiny_llama, caplog):
    engine = make_engine(tiny_llama)
    pid = engine.engine_core.engine_pid
    engine.add_request("ok", "Fine prompt", LONG)
    # A token id the embedding does not have, past the frontend's checks.
    bad = EngineCoreRequest("bad", [10**9], LONG, eos_token_id=None, arrival_time=time.time())
    engine.engine_core.add_request(bad)
    with caplog.at_level(logging.ERROR, logger="minivllm"):
        error = step_until_error(engine)
    assert isinstance(error, EngineDeadError)
    assert isinstance(error.__cause__, IndexError)  # the core's own exception, rebuilt
    assert "Traceback in the engine core process" in str(error.__cause__.__cause__)
    assert any("engine core died" in r.getMessage() for r in caplog.records)
    assert wait_gone(pid, 10)
    engine.shutdown()


def test_kill_9_makes_every_stream_raise(tiny_llama):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=tiny_llama, max_model_len=512))
    pid = engine.engine_core.engine_pid

    async def stream(i: int, started: asyncio.Event):
        async for _ in engine.generate(f"Prompt {i}", LONG, f"s{i}"):
            started.set()

    async def main():
        started = asyncio.Event()
        tasks = [asyncio.create_task(stream(i, started)) for i in range(3)]
        await started.wait()
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(
            asyncio.gather(*tasks, return_exceptions=True), DEAD_WITHIN_S
        )
        with pytest.raises(EngineDeadError):
            await engine.generate("after", LONG, "after").__anext__()
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert engine.errored and not engine.is_running
    engine.shutdown()


def test_deleting_the_engines_leaves_no_child(tiny_llama):
    from minivllm import LLM

    llm = LLM(tiny_llama, max_model_len=512)
    llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    llm_pid = llm.llm_engine.engine_core.engine_pid
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=tiny_llama, max_model_len=512))

    async def use(async_engine):
        return [o async for o in async_engine.generate("Hi", SamplingParams(max_tokens=2), "x")]

    asyncio.run(use(engine))
    async_pid = engine.engine_core.engine_pid
    assert pid_alive(llm_pid) and pid_alive(async_pid)
    del llm, engine
    gc.collect()
    assert wait_gone(llm_pid, 10) and wait_gone(async_pid, 10)
    assert engine_children(os.getpid()) == []


_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from minivllm import LLM, SamplingParams

    llm = LLM({model!r}, max_model_len=256)
    llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    print(llm.llm_engine.engine_core.engine_pid, flush=True)
    how = sys.argv[1]
    if how == "exception":
        raise RuntimeError("the user's program failed")
    if how == "wait":
        time.sleep(600)
    """
)


@pytest.mark.parametrize(
    "how",
    [
        "exit",  # atexit shuts the core down
        pytest.param("exception", marks=pytest.mark.slow),  # the same path as "exit"
        pytest.param("sigterm", marks=pytest.mark.slow),  # the same path as "sigkill"
        "sigkill",  # the core notices that its parent is gone
    ],
)
def test_no_orphan_when_the_frontend_exits(tiny_llama, tmp_path, how):
    script = tmp_path / "frontend.py"  # no __main__ guard: like many users' scripts
    script.write_text(_SCRIPT.format(model=tiny_llama))
    arg = how if how in ("exit", "exception") else "wait"
    proc = subprocess.Popen(
        [sys.executable, str(script), arg],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read()
        engine_pid = int(line)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif how == "sigkill":
            proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == {"exit": 0, "exception": 1}.get(how, proc.returncode)
    assert wait_gone(engine_pid, 15), f"engine core {engine_pid} outlived its frontend"
