"""hermes (Qwen2.5's `<tool_call>` blocks): every split of a scripted output streams exactly
the whole-output result, and that result is the calls the text holds."""

from __future__ import annotations

import json

import pytest

from minivllm.entrypoints.openai.tool_parsers import ToolParserManager
from tests.entrypoints.openai.tool_parsers.utils import assert_streams_equal_whole, whole


def make():
    return ToolParserManager.get_tool_parser("hermes")(None)


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Hello, world!", "Hello, world!", []),
        ("a < b, and <tool", "a < b, and <tool", []),  # a marker's beginning, never finished
        ("<<tool_call", "<<tool_call", []),
        ("", "", []),
        (block(WEATHER), "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        (
            "Let me check.\n" + block(WEATHER),
            "Let me check.\n",
            [("get_weather", {"city": "Paris", "unit": "celsius"})],
        ),
        (
            block(WEATHER) + "\n" + block('{"name": "get_time", "arguments": {"tz": "CET"}}'),
            "",
            [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "CET"})],
        ),
        # Braces, quotes, backslashes and markers inside strings; nesting; unicode.
        (
            block(
                '{"name": "run", "arguments": {"code": "if (a) { b(\\"}\\") }", '
                '"tags": ["</tool_call>", {"x": [1, 2.5e3, null, true]}], "s": "héllo ☃"}}'
            ),
            "",
            [
                (
                    "run",
                    {
                        "code": 'if (a) { b("}") }',
                        "tags": ["</tool_call>", {"x": [1, 2.5e3, None, True]}],
                        "s": "héllo ☃",
                    },
                )
            ],
        ),
        # Arguments before the name; a call without arguments; no closing tag (EOS).
        (block('{"arguments": {"q": 1}, "name": "f"}'), "", [("f", {"q": 1})]),
        (block('{"name": "now"}'), "", [("now", {})]),
        ('<tool_call>{"name":"f","arguments":{}}', "", [("f", {})]),
        # Text after the calls is dropped, as vLLM does.
        (block(WEATHER) + "\nDone.", "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ],
)
def test_streamed_equals_whole(text, content, calls):
    got_content, got_calls = assert_streams_equal_whole(make, text)
    assert got_content == content
    assert [(name, json.loads(args)) for name, args in got_calls] == calls


def test_arguments_are_the_models_text():
    """Not reserialized: streamed fragments and the whole call are the same bytes."""
    text = block('{"name": "f", "arguments": {"a" :  [1,2],"b":"x"}}')
    assert assert_streams_equal_whole(make, text)[1] == [("f", '{"a" :  [1,2],"b":"x"}')]


def test_scalar_arguments_are_sent_whole():
    text = block('{"name": "f", "arguments": 12 }')
    assert assert_streams_equal_whole(make, text)[1] == [("f", "12")]


def test_a_call_that_does_not_parse_leaves_the_output_as_content():
    text = "Sure. " + block('{"name": "f", "arguments": {"a": }}')
    info = make().extract_tool_calls(text)
    assert not info.tools_called and info.content == text
    truncated = '<tool_call>\n{"name": "f", "arguments": {"a": 1'
    assert whole(make(), truncated) == (truncated, [])


def test_ids_are_unique_and_registered_names():
    info = make().extract_tool_calls(block(WEATHER) + block(WEATHER))
    assert len({call.id for call in info.tool_calls}) == 2
    assert all(call.id.startswith("chatcmpl-tool-") for call in info.tool_calls)
    assert {"hermes", "llama3_json"} <= set(ToolParserManager.names())
    with pytest.raises(KeyError):
        ToolParserManager.get_tool_parser("nope")
