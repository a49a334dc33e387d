"""Tensor parallelism with worker processes: same greedy tokens as one rank, and faults
that fail the engine fast and leave no process behind."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

from minivllm import LLM, EngineArgs, LLMEngine, SamplingParams
from minivllm.engine.create_config import create_vllm_config
from minivllm.engine.exceptions import EngineDeadError
from minivllm.executor.abstract import WorkerDiedError
from minivllm.executor.multiproc import MultiprocExecutor
from tests.engine.conftest import engine_children, pid_alive, wait_gone
from tests.executor.conftest import worker_pids

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def quicksort(arr):\n",
    "1, 1, 2, 3, 5, 8,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
DEAD_WITHIN_S = 10.0


def test_tp2_greedy_equals_tp1(tiny_model):
    """Llama, Qwen2 (tied embeddings, q/k/v bias) and Qwen3 (q/k norm), 4 heads / 2 KV."""
    params = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2),
        GREEDY,
    ]
    one = LLM(tiny_model, max_model_len=256, enable_multiprocessing=False)
    expected = one.generate(PROMPTS, params, use_tqdm=False)
    one.llm_engine.shutdown()

    two = LLM(tiny_model, max_model_len=256, tensor_parallel_size=2)
    engine_pid = two.llm_engine.engine_core.engine_pid
    workers = worker_pids(engine_pid, 2)
    got = two.generate(PROMPTS, params, use_tqdm=False)
    two.llm_engine.shutdown()

    for a, b in zip(expected, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, a.prompt
    for a, b in zip(expected[1].outputs[0].logprobs, got[1].outputs[0].logprobs):
        assert a.keys() == b.keys()
        for token in a:
            assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-3)
    for a, b in zip(expected[2].prompt_logprobs[1:], got[2].prompt_logprobs[1:]):
        assert a.keys() == b.keys()
    assert all(wait_gone(pid, 10) for pid in [engine_pid, *workers])


def test_a_model_whose_heads_do_not_divide_is_refused(smollm2_path):
    with pytest.raises(ValueError, match="9 attention heads"):
        LLM(smollm2_path, tensor_parallel_size=2)


def test_executor_collective_rpc(tiny_llama_tp):
    """The interface itself, in this process: a call reaches every rank; a worker's
    exception comes back as itself; after a failure every call fails fast."""
    config = create_vllm_config(EngineArgs(model=tiny_llama_tp, tensor_parallel_size=2))
    executor = MultiprocExecutor(config)
    try:
        pids = executor.worker_pids
        # Other tests may leave a child still exiting; the workers must be among ours.
        assert set(pids) <= set(engine_children(os.getpid()))
        assert (
            executor.determine_available_memory() == [config.cache_config.kv_cache_memory_bytes] * 2
        )
        assert (
            executor.collective_rpc("kv_cache_bytes_per_block")
            == [executor.collective_rpc("kv_cache_bytes_per_block", unique_reply_rank=0)[0]] * 2
        )
        with pytest.raises(AttributeError, match="no_such_method") as info:
            executor.collective_rpc("no_such_method")
        assert "Traceback in worker rank" in str(info.value.__cause__)
    except BaseException:
        executor.shutdown()
        raise
    with pytest.raises(WorkerDiedError):
        executor.determine_num_blocks()
    executor.shutdown()
    assert all(wait_gone(pid, 10) for pid in pids)


def step_until_error(engine: LLMEngine) -> BaseException:
    """Step in a thread, so that a hang fails the test instead of blocking it."""

    def loop():
        while True:
            engine.step()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(loop)
        try:
            future.result(timeout=DEAD_WITHIN_S)
        except concurrent.futures.TimeoutError:
            pytest.fail(f"step() still running {DEAD_WITHIN_S} s after a worker died")
        except BaseException as exc:
            return exc
    raise AssertionError("unreachable")


def make_engine(model: str) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=model, max_model_len=512, tensor_parallel_size=2)
    )


def test_killing_a_worker_mid_generation_fails_the_engine_fast(tiny_llama_tp):
    engine = make_engine(tiny_llama_tp)
    engine_pid = engine.engine_core.engine_pid
    workers = worker_pids(engine_pid, 2)
    for i in range(4):
        engine.add_request(str(i), f"Prompt {i}", LONG)
    engine.step()
    os.kill(workers[1], signal.SIGKILL)
    start = time.monotonic()
    error = step_until_error(engine)
    assert isinstance(error, EngineDeadError), error
    assert time.monotonic() - start < DEAD_WITHIN_S
    with pytest.raises(EngineDeadError):
        engine.add_request("late", "Hi", LONG)
    engine.shutdown()
    assert all(wait_gone(pid, 10) for pid in [engine_pid, *workers])


def test_a_worker_dying_while_idle_fails_the_engine(tiny_llama_tp):
    engine = make_engine(tiny_llama_tp)
    engine_pid = engine.engine_core.engine_pid
    workers = worker_pids(engine_pid, 2)
    os.kill(workers[0], signal.SIGKILL)
    deadline = time.monotonic() + DEAD_WITHIN_S
    with pytest.raises(EngineDeadError):  # no request in flight: the core fails by itself
        while time.monotonic() < deadline:
            engine.get_stats()
            time.sleep(0.1)
    cause = engine.engine_core.supervisor.dead_cause
    assert "Worker rank 0" in str(cause) and "SIGKILL" in str(cause)
    engine.shutdown()
    assert all(wait_gone(pid, 10) for pid in [engine_pid, *workers])


def test_workers_exit_when_the_engine_core_is_killed(tiny_llama_tp):
    engine = make_engine(tiny_llama_tp)
    engine_pid = engine.engine_core.engine_pid
    workers = worker_pids(engine_pid, 2)
    os.kill(engine_pid, signal.SIGKILL)
    assert all(wait_gone(pid, 10) for pid in workers), [pid_alive(p) for p in workers]
    engine.shutdown()
