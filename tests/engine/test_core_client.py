"""The engine core clients with real processes and sockets: in-process vs multiprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from minivllm import LLM, EngineArgs, LLMEngine, SamplingParams
from minivllm.engine.arg_utils import multiprocessing_default
from minivllm.engine.core_client import InprocClient, SyncMPClient
from tests.engine.conftest import engine_children, pid_alive, wait_gone

PROMPTS = ["Hello, my name is", "The capital of France is", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def make_engine(multiprocess: bool, model: str | None = None, **kwargs) -> LLMEngine:
    args = EngineArgs(model=model, max_model_len=256, enable_multiprocessing=multiprocess, **kwargs)
    return LLMEngine.from_engine_args(args)


def run_to_completion(engine: LLMEngine, prompts, params, prefix: str = "r") -> dict:
    """request id -> final output, adding every prompt first."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def token_ids(finished: dict) -> list[list[int]]:
    return [finished[k].outputs[0].token_ids for k in sorted(finished)]


@pytest.fixture(scope="module")
def inproc_engine():
    engine = make_engine(False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def mp_engine():
    engine = make_engine(True)
    yield engine
    engine.shutdown()


def test_transport_is_chosen_by_argument_and_environment(monkeypatch, inproc_engine, mp_engine):
    assert isinstance(inproc_engine.engine_core, InprocClient)
    assert isinstance(mp_engine.engine_core, SyncMPClient)
    assert pid_alive(mp_engine.engine_core.engine_pid)
    monkeypatch.delenv("MINIVLLM_ENABLE_MULTIPROCESSING", raising=False)
    assert multiprocessing_default() and EngineArgs().use_multiprocessing()
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
    assert not EngineArgs().use_multiprocessing()
    assert EngineArgs(enable_multiprocessing=True).use_multiprocessing()


def test_multiprocess_outputs_equal_inprocess_greedy(inproc_engine, mp_engine):
    expected = run_to_completion(inproc_engine, PROMPTS, GREEDY)
    got = run_to_completion(mp_engine, PROMPTS, GREEDY)
    assert token_ids(got) == token_ids(expected)
    assert [got[k].outputs[0].text for k in sorted(got)] == [
        expected[k].outputs[0].text for k in sorted(expected)
    ]
    assert all(len(ids) == GREEDY.max_tokens for ids in token_ids(got))


def test_requests_added_while_stepping(mp_engine, inproc_engine):
    """vLLM's LLM Engine Example loop: one new prompt per step."""

    def process(engine):
        pending = list(enumerate(PROMPTS))
        finished = {}
        while pending or engine.has_unfinished_requests():
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(str(i), prompt, GREEDY)
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output.outputs[0].token_ids
        return finished

    assert process(mp_engine) == process(inproc_engine)


def test_stats_through_both_clients(inproc_engine, mp_engine):
    for engine in (inproc_engine, mp_engine):
        idle = engine.get_stats()
        assert idle.num_running_reqs == 0 and idle.kv_cache_usage == 0.0
        assert idle.num_free_blocks == engine.engine_core.num_blocks
        engine.add_request("s", "Count to ten: one, two,", SamplingParams(max_tokens=50))
        engine.step()
        busy = engine.get_stats()
        assert busy.num_running_reqs == 1 and busy.num_free_blocks < idle.num_free_blocks
        assert engine.last_stats is not None and engine.last_stats.num_running_reqs == 1
        # Aborting frees the request's blocks in the core.
        engine.abort_request("s")
        assert not engine.has_unfinished_requests()
        after = engine.get_stats()
        assert after.num_running_reqs == 0 and after.num_free_blocks == idle.num_free_blocks
        assert engine.step() == []  # nothing running: returns at once, stats refreshed
        assert engine.last_stats.num_running_reqs == 0


def test_parallel_sampling_n_through_the_core(mp_engine):
    mp_engine.add_request("n", "Once upon a time", SamplingParams(n=3, temperature=0, max_tokens=6))
    final = None
    while mp_engine.has_unfinished_requests():
        for output in mp_engine.step():
            final = output if output.finished else final
    assert final.request_id == "n"
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in final.outputs}) == 1  # greedy: all the same
    assert mp_engine.get_stats().num_running_reqs == 0


def test_unknown_utility_method_fails_the_call_not_the_engine(mp_engine):
    with pytest.raises(RuntimeError, match="unknown engine core method"):
        mp_engine.engine_core.call_utility("shutdown")
    assert mp_engine.get_stats().num_running_reqs == 0


def test_two_engines_side_by_side_do_not_collide(tiny_llama, mp_engine, inproc_engine):
    first = make_engine(True, model=tiny_llama)
    second = make_engine(True, model=tiny_llama)
    try:
        clients = [first.engine_core, second.engine_core, mp_engine.engine_core]
        addresses = [c.supervisor.input_address for c in clients]
        assert len(set(addresses)) == 3
        assert len({c.engine_pid for c in clients}) == 3
        # Requests in flight in all three engines at once, with the same request ids.
        for engine in (first, second, mp_engine):
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(f"x{i}", prompt, GREEDY)
        results = [{}, {}, {}]
        engines = (first, second, mp_engine)
        while any(e.has_unfinished_requests() for e in engines):
            for engine, done in zip(engines, results):
                for output in engine.step():
                    if output.finished:
                        done[output.request_id] = output.outputs[0].token_ids
        assert results[0] == results[1]
        assert all(len(ids) == GREEDY.max_tokens for r in results for ids in r.values())
        expected = token_ids(run_to_completion(inproc_engine, PROMPTS, GREEDY))
        assert [results[2][f"x{i}"] for i in range(len(PROMPTS))] == expected
    finally:
        pids = [first.engine_core.engine_pid, second.engine_core.engine_pid]
        first.shutdown()
        second.shutdown()
    assert all(wait_gone(pid, 10) for pid in pids)


def test_startup_error_missing_model_is_the_original_error():
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_engine(True, model="/nonexistent/model-dir")
    assert time.monotonic() - start < 10


def test_startup_error_in_the_core_process_is_raised_as_it_was(unsupported_arch_model):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"FooBarForCausalLM.*not supported") as info:
        make_engine(True, model=unsupported_arch_model)
    assert time.monotonic() - start < 60
    # The core's traceback comes along as the cause.
    assert "Traceback in the engine core process" in str(info.value.__cause__)


def test_startup_error_kv_cache_too_small(tiny_llama):
    with pytest.raises(ValueError, match="KV cache"):
        make_engine(True, model=tiny_llama, kv_cache_memory_bytes=1024)


def test_the_entry_points_leave_torch_and_transformers_to_the_core():
    """`from minivllm import LLM` and the CLI import neither: LLM() and `minivllm serve`
    start the engine core's process first, and the two processes import them side by side
    (seconds of start-up)."""
    code = (
        "import sys; from minivllm import LLM, EngineArgs, SamplingParams; LLM; "
        "import minivllm.entrypoints.cli, minivllm.engine.core_client; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize("api", ["LLM", "AsyncLLM"])
def test_a_config_that_fails_stops_the_core_started_for_it(tmp_path, api):
    """The core's process starts before the config is built; when that fails (no such
    model), the error is the frontend's, and the process is gone: at once, not when the
    collector frees the client (the error's traceback, kept here, holds it)."""
    from minivllm import AsyncEngineArgs, AsyncLLM

    before = engine_children(os.getpid())  # the other tests' engines (module fixtures)
    with pytest.raises(FileNotFoundError, match="missing") as kept:
        if api == "LLM":
            LLM(str(tmp_path / "missing"), enable_multiprocessing=True)
        else:
            AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tmp_path / "missing")))
    assert engine_children(os.getpid()) == before, kept


_NEVER_CONFIGURED = textwrap.dedent(
    """
    import time
    from minivllm import EngineArgs
    from minivllm.engine.core_client import start_engine_core

    core = start_engine_core(EngineArgs(enable_multiprocessing=True))
    print(core.engine_pid, flush=True)
    time.sleep(600)
    """
)


def test_a_core_waiting_for_its_config_exits_with_its_frontend(tmp_path):
    script = tmp_path / "frontend.py"
    script.write_text(_NEVER_CONFIGURED)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read()
        engine_pid = int(line)
        assert pid_alive(engine_pid)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_gone(engine_pid, 30), f"engine core {engine_pid} outlived its frontend"


def test_an_in_process_engine_left_open_stops_cleanly_at_exit(tiny_llama):
    """A program that never calls shutdown(): the engine stops at exit before the modules
    its threads need are torn down (it raised an ignored AttributeError there, and with Ray
    actors the interpreter segfaulted)."""
    code = (
        "from minivllm import LLM, SamplingParams\n"
        f"llm = LLM({tiny_llama!r}, max_model_len=64, enable_multiprocessing=False)\n"
        "llm.generate('Hi', SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "print('done', flush=True)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("done")
    assert "Exception ignored" not in run.stderr and "Traceback" not in run.stderr, run.stderr
