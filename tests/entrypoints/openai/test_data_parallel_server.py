"""`minivllm serve --data-parallel-size 2`: /metrics labels each engine core, and once one
core is killed /health says the server is degraded while the other serves on."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.entrypoints.openai.utils import RemoteServer, metric, metrics, request


@pytest.mark.slow  # two engine cores load the bundled model
def test_two_engine_cores_behind_one_server():
    server = RemoteServer(["--max-model-len", "256", "--data-parallel-size", "2"])
    try:
        client = server.get_client()
        for i in range(4):
            out = client.completions.create(
                model=client.models.list().data[0].id, prompt=f"Count to {i}:", max_tokens=4
            )
            assert out.choices[0].finish_reason == "length"
        samples = metrics(server)
        for engine in ("0", "1"):
            metric(samples, "vllm:num_requests_running", engine=engine)  # one series each
        assert (
            sum(metric(samples, "vllm:request_success_total", engine=engine) for engine in "01")
            == 4
        )

        cores = [pid for pid in server.child_pids() if b"spawn_main" in _cmdline(pid)]
        assert len(cores) == 2
        os.kill(cores[1], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while True:
            status, _, body = request("GET", server.url_for("health"))
            if body or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == 200
        health = json.loads(body)
        assert health["status"] == "degraded" and len(health["dead_engines"]) == 1
        out = client.completions.create(
            model=client.models.list().data[0].id, prompt="Still here?", max_tokens=4
        )
        assert out.choices[0].finish_reason == "length"
    finally:
        server.stop()


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()
