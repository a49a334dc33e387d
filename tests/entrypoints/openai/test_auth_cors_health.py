"""A server on a small random-weight Hugging Face directory, with an API key (from
MINIVLLM_API_KEY), restricted CORS origins and its own chat template; at the end its engine
core is killed and /health turns 503."""

from __future__ import annotations

import json
import os
import signal
import time

import openai
import pytest

from tests.conftest import write_tiny_checkpoint
from tests.entrypoints.openai.utils import RemoteServer, post_json, request

pytestmark = pytest.mark.e2e

API_KEY = "test-key-123"
ORIGIN = "http://allowed.example"
TEMPLATE = (
    "{% if mark %}<{{ mark }}>{% endif %}"  # the server's default kwargs set it
    "{% if reasoning_effort is defined %}[effort {{ reasoning_effort }}]{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    return write_tiny_checkpoint("llama", str(folder), smollm2_tokenizer)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = [
        model_dir,
        "--max-model-len", "256",
        "--chat-template", str(template),
        "--default-chat-template-kwargs", '{"mark": "d"}',
        "--enable-request-id-headers", "--enable-force-include-usage",
        "--return-tokens-as-token-ids",
        "--allowed-origins", json.dumps([ORIGIN]),
        "--disable-log-stats",
    ]  # fmt: skip
    remote = RemoteServer(args, env={"MINIVLLM_API_KEY": API_KEY})
    yield remote
    remote.stop()


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_v1_routes_need_the_key(server):
    for method, path, body in [
        ("GET", ("v1", "models"), None),
        ("POST", ("v1", "completions"), {"prompt": "Hi", "max_tokens": 1}),
        ("POST", ("v1", "chat", "completions"), {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        for headers in ({}, auth("wrong-key"), {"Authorization": API_KEY}):
            status, _, data = request(method, server.url_for(*path), body, headers)
            assert status == 401
            error = json.loads(data)["error"]
            assert error["code"] == 401 and error["message"]
    status, _, _ = request("GET", server.url_for("v1", "models"), headers=auth())
    assert status == 200
    for key, expected in ((API_KEY, 200), ("wrong-key", 401)):  # Anthropic's header
        status, _, _ = request("GET", server.url_for("v1", "models"), headers={"x-api-key": key})
        assert status == expected


def test_operational_routes_stay_open(server):
    for path in ("health", "version", "metrics"):
        assert request("GET", server.url_for(path))[0] == 200
    assert post_json(server.url_for("tokenize"), {"prompt": "hi"})[0] == 200


def test_openai_client_with_and_without_the_key(server, model_dir):
    with pytest.raises(openai.AuthenticationError):
        server.get_client(api_key="wrong").models.list()
    client = server.get_client(api_key=API_KEY)
    (model,) = client.models.list().data
    assert model.id == model_dir  # without --served-model-name: the MODEL argument
    completion = client.completions.create(
        model=model.id, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 2


def test_cors_preflight(server):
    headers = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, got, _ = request("OPTIONS", server.url_for("v1", "chat", "completions"), None, headers)
    assert status == 200
    assert got["access-control-allow-origin"] == ORIGIN
    assert "POST" in got["access-control-allow-methods"]
    assert "authorization" in got["access-control-allow-headers"].lower()
    denied = {**headers, "Origin": "http://evil.example"}
    status, got, _ = request("OPTIONS", server.url_for("v1", "completions"), None, denied)
    assert status == 400 and "access-control-allow-origin" not in got
    # Real responses, errors included, carry the header for an allowed origin.
    status, got, _ = request("GET", server.url_for("v1", "models"), headers={"Origin": ORIGIN})
    assert status == 401 and got["access-control-allow-origin"] == ORIGIN


def test_chat_template_flag(server, model_dir, smollm2_tokenizer):
    messages = [{"role": "user", "content": "Hello"}]
    status, body = post_json(server.url_for("tokenize"), {"messages": messages})
    assert status == 200
    expected = smollm2_tokenizer.encode("<d>[user] Hello\n[assistant]", add_special_tokens=False)
    assert body["tokens"] == expected
    # A request's own chat_template_kwargs win over --default-chat-template-kwargs.
    for mark, text in (("r", "<r>[user] Hello\n[assistant]"), ("", "[user] Hello\n[assistant]")):
        status, body = post_json(
            server.url_for("tokenize"),
            {"messages": messages, "chat_template_kwargs": {"mark": mark}},
        )
        assert body["tokens"] == smollm2_tokenizer.encode(text, add_special_tokens=False)
    client = server.get_client(api_key=API_KEY)
    completion = client.chat.completions.create(model=model_dir, messages=messages, max_tokens=2)
    assert completion.usage.prompt_tokens == len(expected)
    with_effort = client.chat.completions.create(
        model=model_dir, messages=messages, max_tokens=2, reasoning_effort="low"
    )  # the template reads reasoning_effort, as gpt-oss's does
    rendered = smollm2_tokenizer.encode(
        "<d>[effort low][user] Hello\n[assistant]", add_special_tokens=False
    )
    assert with_effort.usage.prompt_tokens == len(rendered)


def test_vllms_flags_for_every_request(server, model_dir):
    """--enable-request-id-headers (on a 401 too), --enable-force-include-usage (a stream
    that did not ask for usage ends with it), --return-tokens-as-token-ids."""
    url = server.url_for("v1", "completions")
    body = {"model": model_dir, "prompt": "Hi", "max_tokens": 2, "logprobs": 1, "ignore_eos": True}
    status, headers, _ = request("POST", url, body, {**auth(), "X-Request-Id": "mine"})
    assert status == 200 and headers["x-request-id"] == "mine"
    status, headers, _ = request("POST", url, body)  # no key: a 401, still with an id
    assert status == 401 and len(headers["x-request-id"]) == 32
    status, _, data = request("POST", url, body, auth())
    tokens = json.loads(data)["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 2 and all(t.startswith("token_id:") for t in tokens)
    status, _, data = request("POST", url, {**body, "stream": True}, auth())
    events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 2


def test_dead_engine_makes_health_503(server):
    """Runs last in this module: it kills the server's engine core."""
    os.kill(server.engine_core_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 10
    status = 200
    while time.monotonic() < deadline and status == 200:
        status, _, data = request("GET", server.url_for("health"))
        time.sleep(0.1)
    assert status == 503
    assert json.loads(data)["error"]["code"] == 503
    status, body = post_json(
        server.url_for("v1", "completions"),
        {"prompt": "Hi", "max_tokens": 2},
        headers=auth(),
    )
    assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
    status, body = post_json(
        server.url_for("v1", "chat", "completions"),
        {"messages": [{"role": "user", "content": "Hi"}], "stream": True},
        headers=auth(),
    )
    assert status == 503  # before any stream starts
    assert request("GET", server.url_for("metrics"))[0] == 200  # still answers
