"""The Responses API through the real `openai` SDK's responses.create against `minivllm
serve`: plain and streamed (the same text), a required function tool round-tripped through
function_call_output, text.format json_schema, previous_response_id and the store."""

from __future__ import annotations

import json

import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.utils import request

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France? Answer in one word."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def test_a_response_says_what_chat_says_streamed_or_not(client):
    whole = client.responses.create(
        model=MODEL_NAME, input=QUESTION, max_output_tokens=16, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
    )
    assert whole.object == "response" and whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    kinds, deltas, final = [], [], None
    with client.responses.stream(
        model=MODEL_NAME, input=QUESTION, max_output_tokens=16, temperature=0
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == final.output_text == whole.output_text


def test_instructions_and_previous_response_id_continue_a_conversation(client):
    first = client.responses.create(
        model=MODEL_NAME, input="My name is Ada.", instructions="Be brief.",
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=MODEL_NAME, input="What is my name?", previous_response_id=first.id,
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    alone = client.responses.create(
        model=MODEL_NAME, input="What is my name?", max_output_tokens=8, temperature=0
    )
    assert second.usage.input_tokens > alone.usage.input_tokens  # the history was sent
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=MODEL_NAME, input="x", previous_response_id="resp_gone", max_output_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_never_stored")


def test_a_required_function_tool_round_trips_through_its_output(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.responses.create(
        model=MODEL_NAME, input=ask, tools=[WEATHER], tool_choice="required",
        max_output_tokens=64, temperature=0,
    )  # fmt: skip
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow = client.responses.create(
        model=MODEL_NAME,
        input=[*ask, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 21 C"}],
        tools=[WEATHER], max_output_tokens=16, temperature=0,
    )  # fmt: skip
    assert follow.output_text


def test_a_streamed_function_call_is_the_whole_ones(client):
    """Acceptance 3: the same call, byte for byte, whole or streamed; the argument deltas
    add up to the arguments."""
    kwargs = dict(model=MODEL_NAME, input="What is the weather in Paris?", tools=[WEATHER],
                  tool_choice="required", max_output_tokens=64, temperature=0)  # fmt: skip
    whole = client.responses.create(**kwargs)
    deltas = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()

    def calls(response) -> list[tuple[str, str]]:
        return [(i.name, i.arguments) for i in response.output if i.type == "function_call"]

    assert calls(whole) and calls(final) == calls(whole)
    assert "".join(deltas) == "".join(arguments for _, arguments in calls(whole))


def test_text_format_json_schema_gives_that_json(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    reply = client.responses.create(
        model=MODEL_NAME, input="Name a city in France as JSON.", max_output_tokens=48,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(reply.output_text)["city"], str)


def test_bad_input_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL_NAME, input=[{"type": "web_search_call"}])
    assert "web_search_call" in str(info.value)


@pytest.mark.parametrize(
    "raw, place",
    [
        (b'{"input": "hi", "metadata": {"a": "\\ud800"}}', "metadata.a"),
        (b'{"input": "hi", "tools": [{"type": "\\udfff"}]}', "tools[0].type"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_place(server, raw, place):
    """Strings the answer echoes (metadata, tools) failed its encoding: a 500 before."""
    status, _, data = request("POST", server.url_for("v1", "responses"), raw)
    assert status == 400, data
    assert f"`{place}` is not valid UTF-8" in json.loads(data)["error"]["message"]


def test_hosted_tools_are_left_out_and_namespaces_opened(client):
    """Codex offers web_search and groups tools in namespaces: the hosted tool is not the
    server's to run (the model never sees it), a namespace's functions are offered."""
    grouped = {"type": "namespace", "name": "weather", "description": "Weather tools.",
               "tools": [WEATHER]}  # fmt: skip
    reply = client.responses.create(
        model=MODEL_NAME, input="What is the weather in Paris?", max_output_tokens=32,
        tools=[{"type": "web_search"}, grouped], tool_choice="required", temperature=0,
    )  # fmt: skip
    assert [item.type for item in reply.output] == ["function_call"]
    assert reply.output[0].name == "get_weather"
