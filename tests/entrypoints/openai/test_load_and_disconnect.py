"""Clients that go away free their requests at once; 64 concurrent streams all complete with
exact usage, and /metrics counts what was sent."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.utils import metric, metrics, open_stream

pytestmark = pytest.mark.e2e

LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}


def wait_for(server, predicate, timeout: float) -> tuple[bool, float]:
    """Poll /metrics until predicate(samples) holds; (held, seconds waited).

    It holds in time if a poll asked for within the timeout sees it: the engine core
    answers between two steps, so a slow step delays the answer, not the abort (sent to
    the core before the question).
    """
    start = time.monotonic()
    while True:
        asked = time.monotonic() - start
        if asked > timeout:
            return False, asked
        if predicate(metrics(server)):
            return True, asked
        time.sleep(0.05)


def engine_idle(samples) -> bool:
    return (
        metric(samples, "vllm:num_requests_running") == 0
        and metric(samples, "vllm:num_requests_waiting") == 0
        and metric(samples, "vllm:kv_cache_usage_perc") == 0.0
    )


def engine_busy(samples) -> bool:
    return metric(samples, "vllm:num_requests_running") >= 1


def close_hard(conn) -> None:
    """Close the client's socket at once, as a killed client would."""
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_client_disconnect_frees_the_request(server, path):
    assert wait_for(server, engine_idle, 10)[0]
    body = {"model": MODEL_NAME, "stream": True, **LONG}
    if path == "/v1/completions":
        body["prompt"] = "Tell me a very long story:"
    else:
        body["messages"] = [{"role": "user", "content": "Tell me a very long story."}]
    conn = open_stream(server, path, body)
    response = conn.getresponse()
    assert response.status == 200
    events = 0
    while events < 4:  # a few chunks
        line = response.fp.readline()
        assert line, "the stream ended early"
        events += line.startswith(b"data: ")
    assert engine_busy(metrics(server))
    close_hard(conn)
    freed, waited = wait_for(server, engine_idle, 1.0)
    assert freed, f"the engine still runs the request {waited:.2f} s after the disconnect"


def test_non_streaming_client_disconnect_frees_the_request(server):
    assert wait_for(server, engine_idle, 10)[0]
    body = {"model": MODEL_NAME, "prompt": "Tell me a very long story:", **LONG}
    conn = open_stream(server, "/v1/completions", body)
    assert wait_for(server, engine_busy, 30)[0]
    close_hard(conn)
    freed, waited = wait_for(server, engine_idle, 1.0)
    assert freed, f"the engine still runs the request {waited:.2f} s after the disconnect"


def test_64_concurrent_streams(server, smollm2_tokenizer):
    num_clients, max_tokens = 64, 4
    prompts = [f"Request number {i} says:" for i in range(num_clients)]
    before = metrics(server)

    async def one(client, prompt):
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        return chunks

    async def main():
        client = server.get_async_client()
        return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    total_prompt = total_completion = 0
    for prompt, chunks in zip(prompts, results):
        *token_chunks, last = chunks
        usage = last.usage
        assert usage is not None and last.choices == []
        assert usage.prompt_tokens == len(smollm2_tokenizer.encode(prompt))
        assert usage.completion_tokens == max_tokens
        assert usage.total_tokens == usage.prompt_tokens + max_tokens
        assert token_chunks[-1].choices[0].finish_reason == "length"
        assert len({c.id for c in chunks}) == 1
        total_prompt += usage.prompt_tokens
        total_completion += usage.completion_tokens

    after = metrics(server)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == total_prompt
    assert delta("vllm:generation_tokens_total") == total_completion
    assert delta("vllm:request_success_total", finished_reason="length") == num_clients
    assert delta("vllm:e2e_request_latency_seconds_count") == num_clients
    assert delta("vllm:time_to_first_token_seconds_count") == num_clients
    assert engine_idle(after)
