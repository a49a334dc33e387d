"""A request that fails alone inside the engine gets a 500 (or, streaming, an error event
and [DONE]); the requests beside it get their normal greedy outputs; the server stays
healthy and serves the next one. The faults come from tests/faults.py, installed in the
server and its engine core process through a sitecustomize on PYTHONPATH."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

from tests import faults
from tests.entrypoints.openai.test_load_and_disconnect import engine_idle, wait_for
from tests.entrypoints.openai.utils import RemoteServer, metric, metrics

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers: 1, 2, 3,"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server():
    root = str(Path(__file__).resolve().parents[3])
    path = [faults.sitecustomize_dir(), root, os.environ.get("PYTHONPATH", "")]
    remote = RemoteServer(
        ["--max-model-len", "512"], env={"PYTHONPATH": os.pathsep.join(p for p in path if p)}
    )
    yield remote
    remote.stop()


def good_body(prompt: str, stream: bool = False) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def faulty_body(kind: str, stream: bool) -> dict:
    body = good_body(PROMPTS[1], stream)
    if kind == "detokenizer":
        body["stop"] = [faults.DETOKENIZER_FAULT_STOP]
    else:
        regex = faults.FILL_FAULT_REGEX if kind == "fill" else faults.ACCEPT_FAULT_REGEX
        body["structured_outputs"] = {"regex": regex}
    return body


async def completion(client: httpx.AsyncClient, body: dict) -> tuple[int, str | dict]:
    """(status, text) of a completion; streaming: (status, text) or (status, error event)."""
    if not body["stream"]:
        response = await client.post("/v1/completions", json=body)
        data = response.json()
        return response.status_code, data if "error" in data else data["choices"][0]["text"]
    text, error, done = "", None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    error = chunk
                else:
                    text += chunk["choices"][0]["text"]
    assert done, "the stream ended without [DONE]"
    return response.status_code, error or text


def test_a_fault_in_one_request_fails_it_alone(server):
    """Each kind of fault, streaming and not, in one batch beside good requests."""
    faulty = [("fill", False), ("accept", True), ("detokenizer", False), ("detokenizer", True)]

    async def main():
        async with httpx.AsyncClient(base_url=server.url_root, timeout=300) as client:
            solo = [await completion(client, good_body(p)) for p in PROMPTS]
            assert all(status == 200 for status, _ in solo), solo
            # Compile the grammars once, so that below the faulty requests start beside the
            # others (one token: before any fault).
            for kind in ("fill", "accept"):
                body = {**faulty_body(kind, False), "max_tokens": 1}
                assert (await completion(client, body))[0] == 200
            bodies = [good_body(p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)]
            bodies += [faulty_body(kind, stream) for kind, stream in faulty]
            results = await asyncio.gather(*(completion(client, b) for b in bodies))
            after = await completion(client, good_body(PROMPTS[2]))
            return solo, results, after

    solo, results, after = asyncio.run(main())
    good, failed = results[: len(PROMPTS)], results[len(PROMPTS) :]
    assert good == solo
    for (kind, stream), (status, body) in zip(faulty, failed):
        if stream:  # the stream had started: an error event, then [DONE]
            assert status == 200 and body["error"]["code"] == 500, (kind, body)
        else:
            assert status == 500, (kind, body)
            assert body["error"]["type"] == "InternalServerError", (kind, body)
    assert after == solo[2]
    idle, _ = wait_for(server, engine_idle, 30)
    assert idle
    samples = metrics(server)
    assert metric(samples, "vllm:request_success_total", finished_reason="error") == len(faulty)
    assert server.proc.poll() is None
    log = server.log_text()
    assert "InjectedFault" in log and "engine core died" not in log
