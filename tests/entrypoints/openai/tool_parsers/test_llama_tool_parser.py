"""llama3_json (Llama 3.x JSON calls): every split streams exactly the whole result."""

from __future__ import annotations

import json

import pytest

from minivllm.entrypoints.openai.tool_parsers import ToolParserManager
from tests.entrypoints.openai.tool_parsers.utils import assert_streams_equal_whole, whole


def make():
    return ToolParserManager.get_tool_parser("llama3_json")(None)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("The answer is 4.", "The answer is 4.", []),
        ("  not json", "  not json", []),
        ("<|python", "<|python", []),
        ("   ", "   ", []),
        ('{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
        ('<|python_tag|>{"name": "f", "arguments": {"a": "}{"}}', "", [("f", {"a": "}{"})]),
        (
            '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": [2]}}',
            "",
            [("f", {"a": 1}), ("g", {"b": [2]})],
        ),
        ('\n{"parameters": {"x": null}, "name": "h"}', "", [("h", {"x": None})]),
        ('{"name": "f", "parameters": {}} and then words', "", [("f", {})]),
    ],
)
def test_streamed_equals_whole(text, content, calls):
    got_content, got_calls = assert_streams_equal_whole(make, text)
    assert got_content == content
    assert [(name, json.loads(args)) for name, args in got_calls] == calls


def test_a_call_that_does_not_parse_leaves_the_output_as_content():
    text = '{"name": "f", "parameters": {"a": 1'
    assert whole(make(), text) == (text, [])
