"""Tool calling and reasoning through a real `minivllm serve` and the openai client.

On the bundled model (whose template knows no tools), tool_choice "required" and a named
function are enforced by structured outputs: every answer is a call to a declared function
whose arguments validate, streamed and not, and the stream concatenates to the same call.
A second server (hermes parser, qwen3 reasoning parser, a template that shows the tools)
checks "auto" parsing, the tools in the prompt, the tool-call history and reasoning_content.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.utils import RemoteServer, post_json

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a zone.", "parameters": TIME},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def create(client, model=MODEL_NAME, **kwargs):
    # Generous: a constrained answer of ~40 tokens on a loaded 2-core machine.
    return client.with_options(timeout=600).chat.completions.create(
        model=model, messages=kwargs.pop("messages", MESSAGES), temperature=0, **kwargs
    )


def check_calls(calls: list[tuple[str, str]]) -> None:
    """Each call names a declared function and its arguments validate."""
    assert calls
    for name, arguments in calls:
        assert name in SCHEMAS
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed(client, **kwargs):
    """(content, reasoning, [(name, arguments)], finish_reason) from a stream, checking the
    OpenAI shape: id, type and name first (arguments ""), then argument fragments only."""
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in create(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    assert call.index == len(calls)
                    assert call.id and call.type == "function" and call.function.name
                    assert call.function.arguments == ""
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None
                    calls[call.index][1] += call.function.arguments
            finish = choice.finish_reason or finish
    calls = [(name, args) for name, args in calls.values()]
    return "".join(content), "".join(reasoning), calls, finish


def whole(client, **kwargs):
    response = create(client, **kwargs)
    choice = response.choices[0]
    message = choice.message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    for call in message.tool_calls or []:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    return message.content, getattr(message, "reasoning_content", None), calls, choice.finish_reason


# ---------------------------------------------------------------------------- forced calls


@pytest.mark.parametrize("parallel", [None, False])
def test_required(client, parallel):
    # With calls in parallel the grammar allows any number of them, and the bundled 135M
    # model may repeat its call greedily until max_tokens: it did on an AVX2-only CPU (Zen 3)
    # while it closed the list on the AVX-512 machines before (the kernels' float sums
    # differ between the two, and a near-tie went the other way). A mild repetition
    # penalty, as a user would set, lets it close the list on both.
    extra = (
        {"extra_body": {"repetition_penalty": 1.1}}
        if parallel is None
        else {"parallel_tool_calls": parallel}
    )
    content, _, calls, finish = whole(
        client, tools=TOOLS, tool_choice="required", max_tokens=160, **extra
    )
    assert content is None and finish == "tool_calls"
    check_calls(calls)
    if parallel is False:
        assert len(calls) == 1
        return
    s_content, _, s_calls, s_finish = streamed(
        client, tools=TOOLS, tool_choice="required", max_tokens=160, **extra
    )
    assert (s_content, s_calls, s_finish) == ("", calls, "tool_calls")


def test_named_function(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    content, _, calls, finish = whole(client, tools=TOOLS, tool_choice=choice, max_tokens=64)
    assert content is None and finish == "stop"  # named: "stop", as vLLM and OpenAI
    assert [name for name, _ in calls] == ["get_time"]
    check_calls(calls)
    s_content, _, s_calls, s_finish = streamed(
        client, tools=TOOLS, tool_choice=choice, max_tokens=64
    )
    assert (s_content, s_calls, s_finish) == ("", calls, "stop")


def test_tool_choice_none_answers_in_text(client):
    content, _, calls, finish = whole(client, tools=TOOLS, tool_choice="none", max_tokens=8)
    plain = create(client, max_tokens=8).choices[0].message.content
    assert (content, calls) == (plain, []) and finish == "length"


def test_history_with_calls_and_results(client):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    response = create(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "--tool-call-parser to be set"),
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "does not match any of the specified `tools`",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "Invalid value for `function`"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        ({"tools": [{"type": "function"}]}, "function"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "not both"),
    ],
)
def test_bad_tool_requests_are_400(server, body, message):
    status, error = post_json(
        server.url_for("v1/chat/completions"),
        {"messages": MESSAGES, "max_tokens": 4, **body},
    )
    assert status == 400, error
    assert message in error["error"]["message"]


def test_required_with_no_tools_is_none(client):
    """As OpenAI: "required" with an empty tool list answers in text."""
    content, _, calls, _ = whole(client, tools=[], tool_choice="required", max_tokens=4)
    assert content and calls == []


# ---------------------------------------------------------------------------- auto, reasoning

# ChatML with the tools in a system turn and the calls of the history as hermes blocks.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n'
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- endif %}{% endif %}"
)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_time", "arguments": \{"timezone": "(UTC|CET)"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    remote = RemoteServer(
        [
            "--max-model-len", "1024",
            "--served-model-name", MODEL_NAME,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3",
            "--chat-template", str(template),
        ]
    )  # fmt: skip
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def auto_client(auto_server):
    return auto_server.get_client()


def test_auto_parses_a_hermes_call(auto_client):
    """The output is forced into a hermes block (a regex): the parser makes it a call. With
    thinking turned off by the template, the constraint holds from the first token."""
    extra = {"structured_outputs": {"regex": HERMES_CALL}, **NO_THINKING}
    kwargs = dict(tools=TOOLS, max_tokens=64, extra_body=extra)
    content, reasoning, calls, finish = whole(auto_client, **kwargs)
    assert (content, reasoning, finish) == (None, None, "tool_calls")
    assert len(calls) == 1 and calls[0][0] == "get_time"
    check_calls(calls)
    assert streamed(auto_client, **kwargs) == ("", "", calls, "tool_calls")


def test_auto_without_a_call_is_content(auto_client):
    content, reasoning, calls, finish = whole(auto_client, tools=TOOLS, max_tokens=12)
    assert content and reasoning is None and calls == [] and finish == "length"
    assert streamed(auto_client, tools=TOOLS, max_tokens=12) == (content, "", [], "length")


def test_tools_and_history_reach_the_template(auto_server, auto_client):
    plain = create(auto_client, max_tokens=1).usage.prompt_tokens
    with_tools = create(auto_client, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain + 50
    # /tokenize takes the tools too (as vLLM's): the same prompt as the chat request's.
    _, body = post_json(auto_server.url_for("tokenize"), {"messages": MESSAGES, "tools": TOOLS})
    assert body["count"] == with_tools.usage.prompt_tokens
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"timezone": "CET"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    _, body = post_json(auto_server.url_for("tokenize"), {"messages": history})
    _, body = post_json(auto_server.url_for("detokenize"), {"tokens": body["tokens"]})
    text = body["prompt"]
    # The arguments reach the template as an object (tojson renders it, not a string).
    assert '"arguments": {"timezone": "CET"}' in text


def test_reasoning_content(auto_server, auto_client):
    """A prompt that leaves <think> open: the model's text is reasoning (qwen3 parser)."""
    messages = [*MESSAGES, {"role": "assistant", "content": "<think>\nThe user asks"}]
    kwargs = dict(
        messages=messages,
        max_tokens=8,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    content, reasoning, calls, finish = whole(auto_client, **kwargs)
    assert content is None and reasoning and calls == [] and finish == "length"
    assert streamed(auto_client, **kwargs) == ("", reasoning, [], "length")
    # The same prompt's plain completion is the reasoning.
    _, body = post_json(
        auto_server.url_for("tokenize"),
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
    )
    plain = auto_client.completions.create(
        model=MODEL_NAME, prompt=body["tokens"], max_tokens=8, temperature=0
    )
    assert plain.choices[0].text == reasoning


def test_auto_flags_are_checked_at_start():
    with pytest.raises(RuntimeError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        RemoteServer(["--enable-auto-tool-choice"])
    with pytest.raises(RuntimeError, match="invalid tool call parser: nope"):
        RemoteServer(["--enable-auto-tool-choice", "--tool-call-parser", "nope"])


def test_openai_error_type(auto_client):
    with pytest.raises(openai.BadRequestError):
        create(
            auto_client,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
