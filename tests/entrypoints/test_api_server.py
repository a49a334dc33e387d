"""The simple demo server, `python -m minivllm.entrypoints.api_server`, as a real process."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from tests.entrypoints.openai.utils import RemoteServer, post_json, request

pytestmark = pytest.mark.e2e

SEED_FLAGS = [
    "--max-num-seqs", "500", "--trust-remote-code", "--enforce-eager",
    "--max-num-batched-tokens", "512", "--enable-chunked-prefill",
    "--gpu-memory-utilization", "0.02", "--enable-log-requests", "--max-model-len", "256",
]  # fmt: skip


@pytest.fixture(scope="module")
def demo_server(tiny_opt):
    server = RemoteServer(
        ["--model", tiny_opt, *SEED_FLAGS], module="minivllm.entrypoints.api_server"
    )
    yield server
    server.stop()


def test_health_and_generate(demo_server):
    status, _, _ = request("GET", demo_server.url_for("health"))
    assert status == 200
    body = {"prompt": "Hello, my name is", "max_tokens": 5, "temperature": 0, "n": 2}
    status, answer = post_json(demo_server.url_for("generate"), body)
    assert status == 200, answer
    assert len(answer["text"]) == 2
    assert all(text.startswith("Hello, my name is") for text in answer["text"])
    assert answer["text"][0] == answer["text"][1]  # greedy


def test_stream_sends_nul_separated_json_ending_with_the_full_answer(demo_server):
    body = {"prompt": "Hi", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    _, whole = post_json(demo_server.url_for("generate"), body)
    status, _, data = request("POST", demo_server.url_for("generate"), {**body, "stream": True})
    assert status == 200
    assert data.endswith(b"\0")
    chunks = [json.loads(part) for part in data.split(b"\0")[:-1]]
    assert len(chunks) > 1
    assert chunks[-1] == whole
    lengths = [len(chunk["text"][0]) for chunk in chunks]
    assert lengths == sorted(lengths)  # each chunk holds the text so far


def test_bad_requests_are_400_and_unknown_fields_are_ignored(demo_server):
    url = demo_server.url_for("generate")
    assert post_json(url, {"max_tokens": 2})[0] == 400
    assert post_json(url, {"prompt": "x", "temperature": -1})[0] == 400
    status, _ = post_json(url, {"prompt": "x", "max_tokens": 2, "slo": 0.05, "not_a_field": 1})
    assert status == 200
    assert "present in the request but ignored: not_a_field" in demo_server.log_text()
    assert post_json(url, {"prompt": "x", "is_latency_sensitive": "maybe"})[0] == 400


def test_a_stream_whose_client_leaves_is_aborted(demo_server):
    conn = http.client.HTTPConnection(demo_server.host, demo_server.port, timeout=60)
    # As many tokens as the tiny model's 512 positions allow: a request that finishes before
    # the server writes into the closed connection has nothing left to abort (the engine
    # process can run far ahead of a frontend starved of CPU, as on a loaded CI machine).
    body = {"prompt": "Go", "max_tokens": 500, "ignore_eos": True, "stream": True}
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.read(1)  # the first chunk has come: the request runs
    conn.close()
    deadline = time.monotonic() + 30
    while "Aborted request" not in demo_server.log_text():
        assert time.monotonic() < deadline, demo_server.log_text()
        time.sleep(0.2)


def test_profile_routes_trace_the_engine_core_of_both_servers(tiny_opt, tmp_path):
    import glob

    from tests.engine.test_profiler import RANGES

    for i, module in enumerate(
        ["minivllm.entrypoints.openai.api_server", "minivllm.entrypoints.api_server"]
    ):
        folder = tmp_path / str(i)
        server = RemoteServer(
            ["--model", tiny_opt, "--max-model-len", "128"],
            env={"VLLM_TORCH_PROFILER_DIR": str(folder)},
            module=module,
        )
        try:
            assert request("POST", server.url_for("start_profile"))[0] == 200
            if i == 0:
                url, body = server.url_for("v1", "completions"), {"prompt": "Hi", "max_tokens": 3}
            else:
                url, body = server.url_for("generate"), {"prompt": "Hi", "max_tokens": 3}
            assert post_json(url, body)[0] == 200
            assert request("POST", server.url_for("stop_profile"))[0] == 200
        finally:
            server.stop()
        (trace,) = glob.glob(str(folder / "*.json"))
        with open(trace) as f:
            names = {event.get("name") for event in json.load(f)["traceEvents"]}
        assert RANGES <= names


def test_without_a_profiler_folder_there_are_no_profile_routes(demo_server):
    assert request("POST", demo_server.url_for("start_profile"))[0] == 404
