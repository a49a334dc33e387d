"""POST /v1/chat/completions through the official openai client: the chat template, streaming,
usage, n, logprobs, vLLM's chat extras, and parity with LLM.chat."""

from __future__ import annotations

import asyncio

import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.utils import post_json

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def chat_prompt_ids(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=kwargs.pop("add_generation_prompt", True)
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_completion(client, smollm2_tokenizer):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0
    )
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    assert completion.model == MODEL_NAME
    (choice,) = completion.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    num_prompt_tokens = len(chat_prompt_ids(smollm2_tokenizer, MESSAGES))
    assert completion.usage.prompt_tokens == num_prompt_tokens
    assert completion.usage.completion_tokens == 8 or choice.finish_reason == "stop"
    assert completion.usage.total_tokens == num_prompt_tokens + completion.usage.completion_tokens


def test_greedy_chat_equals_llm_chat(client, offline_llm):
    from minivllm import SamplingParams

    messages = [{"role": "user", "content": "Name three colours."}]
    (expected,) = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16))
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0
    )
    assert completion.choices[0].message.content == expected.outputs[0].text
    assert completion.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert completion.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streaming_chat(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    first, *middle, usage_chunk = chunks
    assert first.object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in middle) == (
        full.choices[0].message.content
    )
    assert all(c.choices[0].delta.role is None for c in middle)
    assert middle[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens


def test_streaming_chat_without_usage(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=3, stream=True
        )
    )
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)


def test_chat_n_2(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=6, n=2, temperature=0
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].message.content == completion.choices[1].message.content
    assert completion.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=6,
            n=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1]
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts[0] == texts[1] == completion.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens


def test_stop_and_penalties(client):
    base = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0
    ).choices[0]
    stop = base.message.content.split()[1]
    choice = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=1,
        user="u-1",
        extra_body={"top_k": 5, "min_p": 0.0, "repetition_penalty": 1.0},
    ).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == base.message.content[: base.message.content.index(stop)]


def test_text_content_parts(client):
    as_parts = [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]
    a = client.chat.completions.create(
        model=MODEL_NAME, messages=as_parts, max_tokens=5, temperature=0
    )
    b = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_template_options(server, smollm2_tokenizer):
    url = server.url_for("v1", "chat", "completions")
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1}
    _, with_prompt = post_json(url, body)
    _, without = post_json(url, {**body, "add_generation_prompt": False})
    assert without["usage"]["prompt_tokens"] == len(
        chat_prompt_ids(smollm2_tokenizer, MESSAGES, add_generation_prompt=False)
    )
    assert without["usage"]["prompt_tokens"] < with_prompt["usage"]["prompt_tokens"]
    # Keys the template does not use are passed to it, and ignored by it.
    status, _ = post_json(url, {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200
    status, error = post_json(url, {**body, "chat_template_kwargs": {"tokenize": True}})
    assert status == 400 and error["error"]["param"] == "chat_template_kwargs"


def test_continue_final_message_and_echo(server):
    url = server.url_for("v1", "chat", "completions")
    messages = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
    status, body = post_json(
        url,
        {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": 4,
            "temperature": 0,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
        },
    )
    assert status == 200
    content = body["choices"][0]["message"]["content"]
    assert content.startswith("The capital of France is") and len(content) > 24


def test_chat_logprobs(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.content) == completion.usage.completion_tokens
    assert "".join(item.token for item in logprobs.content) == (
        completion.choices[0].message.content
    )
    for item in logprobs.content:
        assert item.logprob <= 0.0
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.bytes == list(item.token.encode())


def test_async_streaming_chat(server):
    async def main():
        client = server.get_async_client()
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0)
        full = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(stream=True, **kwargs)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == full.choices[0].message.content

    asyncio.run(main())


def test_chat_logprobs_streaming_and_prompt_logprobs(client, server):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [
        item for c in chunks if c.choices[0].logprobs for item in c.choices[0].logprobs.content
    ]
    assert [i.token for i in streamed] == [i.token for i in full.choices[0].logprobs.content]
    assert all(i.top_logprobs == [] for i in streamed)  # top_logprobs not asked for
    status, body = post_json(
        server.url_for("v1", "chat", "completions"),
        {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 1},
    )
    assert status == 200
    prompt_logprobs = body["prompt_logprobs"]
    assert len(prompt_logprobs) == body["usage"]["prompt_tokens"] and prompt_logprobs[0] is None
