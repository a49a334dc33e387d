"""openai (gpt-oss's harmony messages to functions.*): every split of a scripted reply
streams exactly the whole-output result, that result is the calls the reply holds, and
with the openai_gptoss reasoning parser in front the reply splits three ways."""

from __future__ import annotations

import json

import pytest

from minivllm.entrypoints.openai.chat_output import ChoiceOutput
from minivllm.entrypoints.openai.tool_parsers import ToolParserManager
from minivllm.reasoning import ReasoningParserManager
from tests.entrypoints.openai.tool_parsers.utils import assert_streams_equal_whole, splits


def make():
    return ToolParserManager.get_tool_parser("openai")(None)


ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|>"


def call(name: str, args: str, constrain: bool = True) -> str:
    fmt = " <|constrain|>json" if constrain else ""
    return f"<|start|>assistant<|channel|>commentary to=functions.{name}{fmt}<|message|>{args}"


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("<|channel|>final<|message|>It is sunny.", "It is sunny.", []),
        (call("get_weather", '{"city": "Paris"}'), "", [("get_weather", {"city": "Paris"})]),
        # a preamble on the commentary channel, then the call; no format named
        (
            "<|channel|>commentary<|message|>Checking.<|end|>" + call("f", "{}", False),
            "Checking.",
            [("f", {})],
        ),
        # two calls, each message closed
        (
            call("a", '{"x": 1}') + "<|end|>" + call("b", '{"y": "<|end"}'),
            "",
            [("a", {"x": 1}), ("b", {"y": "<|end"})],
        ),
        # the recipient before the channel, as harmony also writes it
        (
            '<|start|>assistant to=functions.g<|channel|>commentary json<|message|>{"k": [1]}',
            "",
            [("g", {"k": [1]})],
        ),
        ("plain text", "plain text", []),
        # a builtin tool's message (not functions.*) is no call
        ("<|channel|>commentary to=browser.search<|message|>q", "q", []),
    ],
)
def test_streamed_equals_whole(text, content, calls):
    got_content, got_calls = assert_streams_equal_whole(make, text)
    assert got_content == content
    assert [(name, json.loads(args)) for name, args in got_calls] == calls


def test_arguments_that_do_not_parse_leave_the_reply_as_content():
    text = call("f", '{"a": ')
    info = make().extract_tool_calls(text)
    assert not info.tools_called and info.content == text


def test_with_the_reasoning_parser_a_reply_splits_three_ways():
    """Reasoning to reasoning_content, the call to tool_calls, nothing left as content;
    streamed in any split, the same."""
    reply = ANALYSIS + call("get_weather", '{"city": "Paris"}')
    reasoning_cls = ReasoningParserManager.get_reasoning_parser("openai_gptoss")

    def output():
        return ChoiceOutput(reasoning_cls(None), make(), prompt=None)

    reasoning, content, calls = output().parse(reply)
    assert (reasoning, content) == ("Need the weather.", None)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    for pieces in splits(reply):
        choice, got = output(), {"reasoning": "", "content": "", "args": ""}
        for k, piece in enumerate(pieces):
            delta = choice.feed(piece, finished=k == len(pieces) - 1)
            if delta is None:
                continue
            got["reasoning"] += delta.reasoning_content or ""
            got["content"] += delta.content or ""
            got["args"] += "".join(c.function.arguments or "" for c in delta.tool_calls)
        assert got == {
            "reasoning": "Need the weather.",
            "content": "",
            "args": '{"city": "Paris"}',
        }, pieces
