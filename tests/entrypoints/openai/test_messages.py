"""Anthropic's Messages API through the real `anthropic` SDK against `minivllm serve`:
the same text as chat completions, streamed or not, a forced tool call round-tripped
through tool_result, count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL_NAME
from tests.entrypoints.openai.utils import post_json

pytestmark = pytest.mark.e2e

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
# The SDK no longer takes sampling fields; the API still does (greedy for comparisons).
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url_root, api_key="none", max_retries=0)


def test_a_message_says_what_the_chat_api_says(claude, client):
    reply = claude.messages.create(model=MODEL_NAME, max_tokens=16, messages=ASK, extra_body=GREEDY)
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=16, messages=ASK, temperature=0
    )
    assert reply.type == "message" and reply.role == "assistant"
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == chat.choices[0].message.content
    assert (
        reply.stop_reason
        == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    )
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens


def test_streamed_and_whole_messages_are_the_same(claude):
    kwargs = dict(model=MODEL_NAME, max_tokens=24, extra_body=GREEDY, messages=ASK,
                  system="You are terse.")  # fmt: skip
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        deltas = [text for text in stream.text_stream]
        final = stream.get_final_message()
    assert "".join(deltas) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_is_reported(claude):
    whole = claude.messages.create(model=MODEL_NAME, max_tokens=32, messages=ASK, extra_body=GREEDY)
    word = whole.content[0].text.split()[0]
    reply = claude.messages.create(
        model=MODEL_NAME, max_tokens=32, messages=ASK, extra_body=GREEDY, stop_sequences=[word]
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == word


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_round_trips_through_tool_result(claude, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=MODEL_NAME, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                  tool_choice={"type": "any"}, messages=ask)  # fmt: skip
    if stream:
        with claude.messages.stream(**kwargs) as s:
            reply = s.get_final_message()
    else:
        reply = claude.messages.create(**kwargs)
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and calls and calls[0].name == "get_weather"
    assert isinstance(calls[0].input.get("city"), str)
    follow = claude.messages.create(
        model=MODEL_NAME,
        max_tokens=16,
        extra_body=GREEDY,
        tools=[WEATHER],
        messages=[
            *ask,
            {"role": "assistant", "content": reply.content},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"},
            ]},
        ],
    )  # fmt: skip
    assert follow.content and follow.content[0].type == "text"


def test_a_streamed_tool_use_is_the_whole_ones(claude):
    """Acceptance 3: the same blocks, whole or streamed; the input_json deltas add up to the
    input."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=MODEL_NAME, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                  tool_choice={"type": "any"}, messages=ask)  # fmt: skip
    whole = claude.messages.create(**kwargs)
    partial = []
    with claude.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = stream.get_final_message()

    def blocks(message) -> list[tuple]:
        return [(b.type, b.name, b.input) if b.type == "tool_use" else (b.type, b.text)
                for b in message.content]  # fmt: skip

    assert blocks(final) == blocks(whole)
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert json.loads("".join(partial)) == use.input
    assert final.stop_reason == whole.stop_reason == "tool_use"


def test_count_tokens_counts_the_rendered_prompt(claude, client, server):
    counted = claude.messages.count_tokens(model=MODEL_NAME, messages=ASK)
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=1, messages=ASK, temperature=0
    )
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_errors_have_anthropics_shape(claude, server):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="no-such-model", max_tokens=8, messages=ASK)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL_NAME, max_tokens=0, messages=ASK)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL_NAME, max_tokens=8, messages=[])
    assert claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=ASK).content


def test_max_tokens_past_the_context_is_a_ceiling(claude, client):
    """Claude Code asks for 32,000 tokens whatever the model: the reply stops where the
    context ends, as chat with max_tokens set to the room left (16,000 here: the SDK wants a
    stream past 21,333)."""
    reply = claude.messages.create(
        model=MODEL_NAME, max_tokens=16000, messages=ASK, extra_body=GREEDY
    )
    prompt = reply.usage.input_tokens
    assert prompt + reply.usage.output_tokens <= MAX_MODEL_LEN
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=MAX_MODEL_LEN - prompt, messages=ASK, temperature=0
    )
    assert reply.content[0].text == chat.choices[0].message.content


def test_a_system_turn_in_the_conversation_is_a_system_message(server, client):
    """Claude Code sends a "system" role message after the first user turn (beside the
    top-level `system`): it reaches the template as the chat API's system message."""
    turns = [ASK[0], {"role": "system", "content": "Answer in French."}]
    status, reply = post_json(
        server.url_for("v1", "messages"),
        {"model": MODEL_NAME, "max_tokens": 8, "messages": turns, "temperature": 0},
    )
    assert status == 200, reply
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=8, messages=turns, temperature=0
    )
    assert reply["content"][0]["text"] == chat.choices[0].message.content
