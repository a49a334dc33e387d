"""Data parallelism on Ray: each engine core a Ray actor of its own placement-group bundle,
spread over the cluster's nodes, talking to the frontend over TCP. On a two-node cluster
started here the replicas run on the two nodes, give one core's greedy tokens, and an
actor killed under load fails only its own requests; a silent (stopped) actor is dropped
within 2 s as well; replicas of two tensor-parallel ranks each give one core's tokens.
All slow (Ray's start alone takes seconds). Skipped without Ray."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read at Ray's import
pytest.importorskip("ray", exc_type=ImportError)  # absent, or installed broken

import ray  # noqa: E402

from minivllm import LLM, AsyncEngineArgs, AsyncLLM  # noqa: E402
from tests.engine.conftest import wait_gone  # noqa: E402
from tests.engine.test_data_parallel import (  # noqa: E402, F401
    GREEDY,
    PROMPTS,
    assert_only_replica_1_failed,
    lose_replica_1,
    tiny_llama_dp,
)
from tests.executor.conftest import tiny_llama_tp, two_ray_nodes, worker_pids  # noqa: E402, F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs in its own process (it joins the test's cluster as a driver): DP=1's greedy tokens
# without Ray; then DP=2 on Ray: its greedy tokens, where its replicas run, and four long
# requests (two a replica) of which replica 1's actor is SIGKILLed once all have started.
_DRIVER = """
import asyncio, json, signal, sys
import ray
from minivllm import LLM, AsyncEngineArgs, AsyncLLM
from tests.engine.test_data_parallel import GREEDY, PROMPTS
from tests.engine.test_data_parallel import lose_replica_1

model = sys.argv[1]
one = LLM(model, seed=0, max_model_len=256)
expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
one.llm_engine.shutdown()


async def main():
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, seed=0, max_model_len=2048, data_parallel_size=2,
        distributed_executor_backend="ray"))
    result = {"expected": expected}
    try:
        client = engine.engine_core
        result["replica_nodes"] = client.engine_nodes
        result["node_resources"] = {
            n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}

        async def greedy(i):
            async for out in engine.generate(PROMPTS[i], GREEDY, request_id=f"g{i}"):
                pass
            return out.outputs[0].token_ids

        result["dp2"] = await asyncio.gather(*(greedy(i) for i in range(len(PROMPTS))))

        result["ends"], result["dead"] = await lose_replica_1(engine, signal.SIGKILL)
    finally:
        engine.shutdown()
    return result


print("RESULT " + json.dumps(asyncio.run(main())))
"""


@pytest.mark.slow  # two Ray nodes start (~10 s), then two engine cores serve 6,000 tokens
def test_replicas_on_two_ray_nodes(tiny_llama_dp, tmp_path):  # noqa: F811
    """Two nodes of two CPUs each, the second with a custom resource: the replicas' bundles
    spread over both (either node could hold both), the greedy tokens are one core's, and
    a killed replica actor's requests end with an error within 2 s while the other
    replica's run to their length."""
    with two_ray_nodes(tmp_path, num_cpus=2, second_node_resources={"dp_node_b": 1}) as env:
        run = subprocess.run(
            [sys.executable, "-c", _DRIVER, tiny_llama_dp],
            env=env, capture_output=True, text=True, timeout=400, cwd=ROOT,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    nodes, resources = result["replica_nodes"], result["node_resources"]
    assert len(set(nodes)) == 2, nodes
    assert sorted("dp_node_b" in resources[node] for node in nodes) == [False, True]
    assert result["dp2"] == result["expected"]
    assert_only_replica_1_failed(result["ends"], result["dead"])


@pytest.mark.slow  # a local Ray cluster starts; two engine cores of two ranks each load
def test_replicas_of_two_ranks_on_a_cluster_the_engine_starts(tiny_llama_tp, monkeypatch):  # noqa: F811
    """No RAY_ADDRESS: the engine starts a local cluster, runs each replica as an actor
    whose tensor-parallel ranks are processes of its node, gives one core's greedy tokens,
    and stops the actors, their workers and the cluster at shutdown."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    one = LLM(tiny_llama_tp, max_model_len=256)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    one.llm_engine.shutdown()

    llm = LLM(
        tiny_llama_tp,
        max_model_len=256,
        data_parallel_size=2,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    client = llm.llm_engine.engine_core
    actors = client.engine_pids
    workers = [pid for actor in actors for pid in worker_pids(actor, 2)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm.llm_engine.shutdown()
    assert got == expected
    assert not ray.is_initialized()  # the cluster it started is stopped
    assert all(wait_gone(pid, 15) for pid in [*actors, *workers])


@pytest.mark.slow  # a local Ray cluster starts; two engine cores serve 3,000 tokens
def test_a_silent_replica_is_dropped_within_2_s(tiny_llama_dp, monkeypatch):  # noqa: F811
    """Replica 1's actor stopped (SIGSTOP: alive to Ray, and silent, as a node cut off
    the network): the heartbeat on its connection ends it, its requests fail within 2 s
    and the other replica's run to their length."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    async def run() -> tuple[list, list[int]]:
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=tiny_llama_dp,
                max_model_len=2048,
                data_parallel_size=2,
                distributed_executor_backend="ray",
            )
        )
        try:
            return await lose_replica_1(engine, signal.SIGSTOP)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine.engine_core.engine_pids[1], signal.SIGKILL)
            engine.shutdown()

    assert_only_replica_1_failed(*asyncio.run(run()))
