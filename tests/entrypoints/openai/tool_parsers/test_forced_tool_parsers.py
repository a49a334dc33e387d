"""tool_choice "required" and named: the schema structured outputs enforce (checked with
jsonschema and compiled by xgrammar), and every split of its output streams exactly the
whole result."""

from __future__ import annotations

import json

import jsonschema
import pytest

from minivllm.entrypoints.openai.protocol import ChatCompletionToolsParam
from minivllm.entrypoints.openai.tool_parsers.forced_tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    named_tool_schema,
    required_tools_schema,
)
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.grammar import check_grammar
from tests.entrypoints.openai.tool_parsers.utils import assert_streams_equal_whole

TOOLS = [
    ChatCompletionToolsParam.model_validate(t)
    for t in [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"$ref": "#/$defs/City"}},
                    "required": ["city"],
                    "$defs": {"City": {"type": "string", "enum": ["Paris", "Oslo"]}},
                },
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
]


def test_required_schema_accepts_calls_and_refuses_others():
    schema = required_tools_schema(TOOLS)
    check_grammar(StructuredOutputsParams(json=schema))  # xgrammar compiles it
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate([{"name": "now", "parameters": {}}] * 2, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"city": "Rome"}}],
        [{"name": "other", "parameters": {}}],
        [{"name": "now"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_tools_schema(TOOLS, parallel_tool_calls=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, single)


def test_named_schema_is_the_functions_parameters():
    assert named_tool_schema(TOOLS, "get_weather") is TOOLS[0].function.parameters
    assert named_tool_schema(TOOLS, "now") == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "text, calls",
    [
        (
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '[\n  {"name": "now", "parameters": {}},\n  {"name": "get_weather", "parameters": '
            '{"city": "Oslo"}}\n]',
            [("now", {}), ("get_weather", {"city": "Oslo"})],
        ),
    ],
)
def test_required_streamed_equals_whole(text, calls):
    content, got = assert_streams_equal_whole(RequiredToolParser, text)
    assert content == ""
    assert [(name, json.loads(args)) for name, args in got] == calls


def test_named_streamed_equals_whole():
    text = '{"city": "Paris", "days": [1, 2]}'
    content, got = assert_streams_equal_whole(lambda: NamedToolParser(name="get_weather"), text)
    assert (content, got) == ("", [("get_weather", text)])
