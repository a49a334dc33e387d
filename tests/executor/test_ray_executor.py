"""The Ray executor: workers as Ray actors, on a cluster the test starts and on one the
engine starts itself. Skipped when Ray (the `ray` extra) is not installed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

# Keep every Ray process of these tests on the loopback address (read at Ray's import).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", exc_type=ImportError)  # absent, or installed broken

from minivllm import LLM, EngineArgs, LLMEngine  # noqa: E402
from minivllm.engine.exceptions import EngineDeadError  # noqa: E402
from tests.engine.conftest import wait_gone  # noqa: E402
from tests.executor.conftest import descendants, processes_named, two_ray_nodes  # noqa: E402
from tests.executor.test_multiproc_executor import (  # noqa: E402
    DEAD_WITHIN_S,
    GREEDY,
    LONG,
    PROMPTS,
    step_until_error,
)
from tests.executor.test_pipeline_parallel import generate, tiny_llama4  # noqa: E402, F401

ACTOR = b"ray::RayWorkerActor"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ray_cluster(monkeypatch_module):
    """A local Ray cluster on 127.0.0.1, started here; engines find it by RAY_ADDRESS."""
    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths are long
    context = ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=temp_dir,
    )
    address = context.address_info["gcs_address"]
    assert address.startswith("127.0.0.1:")
    monkeypatch_module.setenv("RAY_ADDRESS", address)
    yield address
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_engine_on_a_cluster_it_starts_itself(tiny_llama_tp, monkeypatch):
    """No RAY_ADDRESS: the engine starts a local cluster, uses it, and stops it."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    one = LLM(tiny_llama_tp, max_model_len=256, enable_multiprocessing=False)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    one.llm_engine.shutdown()

    two = LLM(
        tiny_llama_tp,
        max_model_len=256,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    engine_pid = two.llm_engine.engine_core.engine_pid
    started = descendants(engine_pid)  # Ray's own processes, and the actors
    assert len([p for p in started if p in processes_named(ACTOR)]) == 2
    got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
    two.llm_engine.shutdown()
    assert got == expected
    assert all(wait_gone(pid, 15) for pid in [engine_pid, *started])


def test_killing_an_actor_fails_the_engine_fast(ray_cluster, tiny_llama_tp):
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=tiny_llama_tp,
            max_model_len=512,
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
        )
    )
    actors = processes_named(ACTOR)
    assert len(actors) == 2
    for i in range(4):
        engine.add_request(str(i), f"Prompt {i}", LONG)
    engine.step()
    os.kill(actors[1], signal.SIGKILL)
    start = time.monotonic()
    error = step_until_error(engine)
    assert isinstance(error, EngineDeadError), error
    assert time.monotonic() - start < DEAD_WITHIN_S
    engine_pid = engine.engine_core.engine_pid
    engine.shutdown()
    assert wait_gone(engine_pid, 10)
    assert all(wait_gone(pid, 15) for pid in actors), "a Ray actor outlived the engine"
    assert processes_named(ACTOR) == []


def test_two_pipeline_stages_as_ray_actors(ray_cluster, tiny_llama4):  # noqa: F811
    """Pipeline parallelism on Ray: each stage an actor of the engine's placement group;
    the greedy tokens (chunked prefill, prefix caching, preemption) are one stage's."""
    expected, _ = generate(tiny_llama4)
    got, preempted = generate(tiny_llama4, pp=2, distributed_executor_backend="ray")
    assert got == expected
    assert preempted > 0


_TWO_NODE_DRIVER = """
import json, sys
import psutil
from tests.executor.test_pipeline_parallel import generate

raylets = []

def record(llm):
    executor = llm.llm_engine.engine_core.engine_core.executor
    raylets.extend(psutil.Process(pid).parent().pid for pid in executor.worker_pids)

staged, preempted = generate(sys.argv[1], pp=2, distributed_executor_backend="ray",
                             inspect=record)
expected, _ = generate(sys.argv[1])
print("RESULT " + json.dumps({"raylets": raylets, "staged": staged, "expected": expected,
                              "preempted": preempted}))
"""


@pytest.mark.slow
def test_two_pipeline_stages_on_two_ray_nodes(tiny_llama4, tmp_path):  # noqa: F811
    """`ray start --head` and a second `ray start --address` (a node of one CPU each, on
    this machine): the two stages are actors of two nodes (children of two raylets), and
    their greedy tokens and logprobs are one stage's, with chunked prefill, prefix caching
    and preemption (test_pipeline_parallel's generate)."""
    with two_ray_nodes(tmp_path, num_cpus=1) as env:
        run = subprocess.run(
            [sys.executable, "-c", _TWO_NODE_DRIVER, tiny_llama4],
            env=env, capture_output=True, text=True, timeout=300, cwd=ROOT,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    assert len(set(result["raylets"])) == 2, result["raylets"]
    assert result["staged"] == result["expected"]
    assert result["preempted"] > 0
