"""`minivllm serve --scheduling-policy slo` on the bundled model: seed 003's curl body is
served and counted as latency-sensitive, a target no step could meet is a 400 saying why,
and a best-effort request with the same prompt is served."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.utils import RemoteServer, metrics, post_json

pytestmark = pytest.mark.slow  # the server calibrates its step-time model at start-up

MODEL_NAME = "smollm"

# Seed 003's body, but for the model's name and a shorter answer.
SEED_003_BODY = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "1 u are loved, sir: They that least lend it"}],
    "temperature": 0.7,
    "length_penalty": 1.0,
    "max_tokens": 8,
    "min_tokens": 8,
    "is_latency_sensitive": "True",
    "slo": 0.05,
}


@pytest.fixture(scope="module")
def server():
    remote = RemoteServer(
        ["--max-model-len", "512", "--served-model-name", MODEL_NAME]
        + ["--scheduling-policy", "slo", "--default-slo-ttft", "30"]
    )
    yield remote
    remote.stop()


def _count(server, kind: str, slo_class: str) -> float:
    name = f"minivllm:slo_{kind}_total"
    return sum(v for k, v in metrics(server).items() if k.startswith(name) and slo_class in k)


def test_seed_003_body_is_served_as_latency_sensitive(server):
    url = server.url_for("v1", "chat", "completions")
    # TPOT 50 ms may be more than this machine's decode step (a 400 then says so); a
    # target of 10 s is met by any machine.
    body = {**SEED_003_BODY, "slo": 10.0}
    before = _count(server, "requests", "latency_sensitive")
    status, answer = post_json(url, body)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 8
    assert _count(server, "requests", "latency_sensitive") == before + 1
    assert _count(server, "requests_attained", "latency_sensitive") >= 1
    status, answer = post_json(url, SEED_003_BODY)
    if status == 400:
        assert "TPOT target (50 ms per token)" in answer["error"]["message"]
    else:
        assert status == 200, answer
    assert "ignored: is_latency_sensitive" not in server.log_text()


def test_a_target_no_step_can_meet_is_a_400_and_best_effort_queues(server):
    url = server.url_for("v1", "completions")
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
    status, answer = post_json(url, {**body, "is_latency_sensitive": True, "slo": 1e-6})
    assert status == 400, answer
    assert "cannot meet its TPOT target" in answer["error"]["message"]
    status, answer = post_json(url, {**body, "slo_ttft": 1e-6})  # a target alone: sensitive
    assert status == 400 and "TTFT target" in answer["error"]["message"], answer
    before = _count(server, "requests", "best_effort")
    status, answer = post_json(url, body)
    assert status == 200, answer
    assert _count(server, "requests", "best_effort") == before + 1
