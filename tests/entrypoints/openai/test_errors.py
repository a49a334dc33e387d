"""Invalid requests get OpenAI-style error bodies with the right status, over raw HTTP and
through the openai client."""

from __future__ import annotations

import json

import openai
import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL_NAME
from tests.entrypoints.openai.utils import post_json, request

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Hi"}]


def assert_error(status: int, body: dict, expected_status: int, param: str | None = None):
    assert status == expected_status, body
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == expected_status
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}.get(
        expected_status, error["type"]
    )
    if param is not None:
        assert error["param"] == param, error
    return error


def completions(server, body):
    return post_json(server.url_for("v1", "completions"), {"model": MODEL_NAME, **body})


def chat(server, body):
    return post_json(server.url_for("v1", "chat", "completions"), {"model": MODEL_NAME, **body})


def test_malformed_json(server):
    status, _, data = request("POST", server.url_for("v1", "completions"), b'{"prompt": "x",')
    error = assert_error(status, json.loads(data), 400)
    assert "JSON" in error["message"]
    status, _, data = request("POST", server.url_for("v1", "completions"), b"[1, 2]")
    assert_error(status, json.loads(data), 400)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, None),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
        ({"prompt": "x", "cache_salt": 5}, "cache_salt"),
    ],
)
def test_bad_values_are_400(server, body, param):
    status, error = completions(server, body)
    assert_error(status, error, 400, param)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "suffix": "end"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, None),
        ({"prompt": "x", "guided_json": {"type": "nope"}}, None),
        ({"prompt": "x", "guided_regex": "(unclosed"}, None),
        ({"prompt": "x", "structured_outputs": {"json": {}, "regex": "a"}}, None),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ],
)
def test_unsupported_fields_are_rejected(server, body, param):
    status, error = completions(server, body)
    assert_error(status, error, 400, param)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
        ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": MESSAGES, "top_logprobs": 2}, None),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages",
        ),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": MESSAGES, "store": True}, "store"),
        ({"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template"),
    ],
)
def test_chat_rejections(server, body, param):
    status, error = chat(server, body)
    assert_error(status, error, 400, param)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template"),
        ({"messages": MESSAGES, "continue_final_message": True}, None),
        ({"messages": []}, "messages"),
    ],
)
def test_tokenize_chat_rejections(server, body, param):
    """/tokenize renders messages as a chat request does, and refuses what it refuses."""
    status, error = post_json(server.url_for("tokenize"), body)
    assert_error(status, error, 400, param)


def test_noop_openai_fields_are_accepted(server):
    status, body = chat(
        server,
        {
            "messages": MESSAGES,
            "max_tokens": 1,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "logit_bias": {},
            "store": False,
            "metadata": {"k": "v"},
            "service_tier": "auto",
            "user": "u",
        },
    )
    assert status == 200, body


def test_prompt_longer_than_context(server):
    status, error = completions(server, {"prompt": [1] * (MAX_MODEL_LEN + 1)})
    assert "maximum context length" in assert_error(status, error, 400)["message"]
    status, error = completions(server, {"prompt": [1] * MAX_MODEL_LEN, "max_tokens": None})
    assert_error(status, error, 400, "prompt")
    long_text = "hello " * (MAX_MODEL_LEN + 10)
    status, error = chat(server, {"messages": [{"role": "user", "content": long_text}]})
    assert_error(status, error, 400, "messages")


def test_max_tokens_too_large(server):
    status, error = completions(server, {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN})
    assert "maximum context length" in assert_error(status, error, 400, "max_tokens")["message"]
    status, error = chat(server, {"messages": MESSAGES, "max_completion_tokens": MAX_MODEL_LEN})
    assert_error(status, error, 400, "max_completion_tokens")


def test_out_of_vocabulary_token_ids(server):
    status, error = completions(server, {"prompt": [1, 2, 10_000_000]})
    assert_error(status, error, 400, "prompt")
    status, error = post_json(server.url_for("detokenize"), {"tokens": [-1]})
    assert_error(status, error, 400, "tokens")


def test_logprobs_limits(server):
    status, error = completions(server, {"prompt": "x", "logprobs": 21})
    assert_error(status, error, 400, "logprobs")
    status, error = completions(server, {"prompt": "x", "prompt_logprobs": 21})
    assert_error(status, error, 400, "prompt_logprobs")
    status, error = completions(server, {"prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert_error(status, error, 400)


def test_bad_token_lists(server):
    status, error = completions(server, {"prompt": "x", "logit_bias": {"10000000": 1}})
    assert_error(status, error, 400, "logit_bias")
    status, error = completions(server, {"prompt": "x", "logit_bias": {"5": 101}})
    assert_error(status, error, 400, "logit_bias")
    status, error = completions(server, {"prompt": "x", "logit_bias": {"five": 1}})
    assert_error(status, error, 400, "logit_bias")
    status, error = completions(server, {"prompt": "x", "allowed_token_ids": [-3]})
    assert_error(status, error, 400, "allowed_token_ids")


def test_priority_needs_priority_scheduling(server):
    status, error = completions(server, {"prompt": "x", "priority": 1})
    assert_error(status, error, 400, "priority")


def test_unknown_model_is_404(server):
    status, error = completions(server, {"prompt": "x", "model": "no-such-model"})
    assert "no-such-model" in assert_error(status, error, 404, "model")["message"]
    status, error = chat(server, {"messages": MESSAGES, "model": "no-such-model"})
    assert_error(status, error, 404)
    status, error = post_json(server.url_for("tokenize"), {"prompt": "x", "model": "nope"})
    assert_error(status, error, 404)


def test_unknown_route_and_method(server):
    status, _, data = request("GET", server.url_for("v1", "nothing-here"))
    assert_error(status, json.loads(data), 404)
    status, _, data = request("GET", server.url_for("v1", "completions"))
    assert_error(status, json.loads(data), 405)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10 * MAX_MODEL_LEN)
    assert "maximum context length" in info.value.message
    assert info.value.body["code"] == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, stream=True, extra_body={"use_beam_search": True}
        )


def test_unknown_fields_are_ignored_with_a_warning(server):
    # Seed 003's curl body: the SLO fields (minivllm's, honoured), and beam search's no-op
    # default.
    extras = {"is_latency_sensitive": "True", "slo": 0.05, "length_penalty": 1.0}
    status, body = chat(server, {"messages": MESSAGES, "max_tokens": 2, **extras})
    assert status == 200, body
    status, body = completions(server, {"prompt": "x", "max_tokens": 2, "not_a_field": 1})
    assert status == 200, body
    log = server.log_text()
    assert "ignored: is_latency_sensitive" not in log
    assert "ignored: not_a_field" in log
