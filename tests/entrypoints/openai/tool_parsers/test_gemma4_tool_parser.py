"""gemma4 (Gemma 4's `<|tool_call>call:name{...}<tool_call|>`): every split of a scripted
output streams exactly the whole-output result, and that result is the calls the text
holds, their arguments turned from Gemma's notation into JSON."""

from __future__ import annotations

import json

import pytest

from minivllm.entrypoints.openai.tool_parsers import ToolParserManager
from minivllm.entrypoints.openai.tool_parsers.gemma4_tool_parser import parse_value
from tests.entrypoints.openai.tool_parsers.utils import assert_streams_equal_whole, whole

Q = '<|"|>'


def make():
    return ToolParserManager.get_tool_parser("gemma4")(None)


def call(body: str) -> str:
    return f"<|tool_call>call:{body}<tool_call|>"


WEATHER = call(f"get_weather{{location:{Q}Paris, FR{Q},days:3}}")


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Hello, world!", "Hello, world!", []),
        ("a <| b, and <|tool", "a <| b, and <|tool", []),  # a marker's beginning, unfinished
        ("", "", []),
        (WEATHER, "", [("get_weather", {"location": "Paris, FR", "days": 3})]),
        (
            "Let me check.\n" + WEATHER,
            "Let me check.\n",
            [("get_weather", {"location": "Paris, FR", "days": 3})],
        ),
        # Calls back to back; no arguments; nesting, lists, literals, quoted braces, unicode.
        (
            WEATHER + call("now{}"),
            "",
            [("get_weather", {"location": "Paris, FR", "days": 3}), ("now", {})],
        ),
        (
            call(
                f"run{{code:{Q}if (a) {{ b(1, [2]) }}{Q}, opts:{{deep:[1, -2.5e3, true, null]}},"
                f" tags:[{Q}x{Q}, {Q}héllo ☃{Q}], ok:false}}"
            ),
            "",
            [
                (
                    "run",
                    {
                        "code": "if (a) { b(1, [2]) }",
                        "opts": {"deep": [1, -2.5e3, True, None]},
                        "tags": ["x", "héllo ☃"],
                        "ok": False,
                    },
                )
            ],
        ),
        # No closing marker (the reply ended): the call as far as it goes.
        (f"<|tool_call>call:f{{a:{Q}b{Q}}}", "", [("f", {"a": "b"})]),
        # Text after the calls is dropped, as hermes does.
        (WEATHER + "<|tool_response>", "", [("get_weather", {"location": "Paris, FR", "days": 3})]),
    ],
)
def test_streamed_equals_whole(text, content, calls):
    got_content, got_calls = assert_streams_equal_whole(make, text)
    assert got_content == content
    assert [(name, json.loads(args)) for name, args in got_calls] == calls


@pytest.mark.parametrize(
    "body",
    ["f{a:}", f"f{{a:{Q}open}}", "f{a:1 b:2}", "f{a:1}}", "f(a=1)", "{a:1}", f"f{{a:{Q}x{Q}"],
)
def test_a_call_that_does_not_parse_leaves_the_output_as_content(body):
    text = "Sure. " + call(body)
    info = make().extract_tool_calls(text)
    assert not info.tools_called and info.content == text


def test_notation():
    text = f"{{ a : {Q} spaced {Q} , b:[ ] }}"
    assert parse_value(text, 0) == ({"a": " spaced ", "b": []}, len(text))
    assert parse_value("bare word}", 0) == ("bare word", 9)  # as the model wrote it
    assert parse_value(f"{{{Q}quoted key{Q}:1}}", 0)[0] == {"quoted key": 1}
    with pytest.raises(ValueError):
        parse_value("", 0)


def test_registered_beside_the_others():
    assert {"gemma4", "hermes", "openai"} <= set(ToolParserManager.names())
    assert whole(make(), WEATHER)[1][0][0] == "get_weather"
