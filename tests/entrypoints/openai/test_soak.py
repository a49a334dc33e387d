"""Soak (issue 20): many concurrent clients, streaming and not, random lengths, a quarter of
the clients going away at random moments, bad requests mixed in. Afterwards nothing runs or
waits, no KV block is in use, RSS is back near its post-warm-up level, and every good
request's greedy output is the one it gets when run alone.

The full run (1,000 requests, 64 clients) is marked slow and prints its figures:
    .venv/bin/python -m pytest -m slow -s tests/entrypoints/openai/test_soak.py
A short one runs in `make test`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.entrypoints.openai.test_load_and_disconnect import engine_idle, wait_for
from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
PROMPTS = [f"Item {i}: the story of a {w}" for i, w in enumerate(
    ["cat", "ship", "river", "clock", "garden", "storm", "violin", "lantern"] * 2
)]  # fmt: skip
BAD_BODIES = [
    {"prompt": "a", "temperature": "NaN-ish"},
    {"prompt": "a", "top_p": 7},
    {"prompt": "a", "stream": "yes"},
    {"prompt": "\ud800"},
    {"prompt": "a", "seed": 2**70},
    {"prompt": "a", "stop_token_ids": [10**9]},
    {"prompt": [10**9]},
    {"prompt": "a", "n": 10**6},
    {"prompt": "a", "max_tokens": 10**6},
]


@dataclass
class Figures:
    requests: int = 0
    good: int = 0
    disconnected: int = 0
    bad_refused: int = 0
    unexpected: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def _token_ids(logprobs_tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def _good_body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": stream,
    }


async def _completion_ids(client: httpx.AsyncClient, body: dict) -> list[int]:
    """The token ids a good request got; raises on any error."""
    if not body["stream"]:
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        return _token_ids(response.json()["choices"][0]["logprobs"]["tokens"])
    tokens: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            logprobs = chunk["choices"][0].get("logprobs")
            if logprobs:
                tokens += logprobs["tokens"]
    return _token_ids(tokens)


def run_soak(
    num_requests: int, num_clients: int, num_prompts: int = len(PROMPTS), seed: int = 0
) -> dict:
    rng = random.Random(seed)
    prompts = PROMPTS[:num_prompts]
    server = RemoteServer(["--max-model-len", "512", "--log-stats-interval", "30"])
    try:
        pids = [server.proc.pid, *server.child_pids()]
        figures = Figures()

        async def main() -> dict:
            limits = httpx.Limits(max_connections=num_clients + 8)
            async with httpx.AsyncClient(
                base_url=server.url_root, timeout=300, limits=limits
            ) as client:
                # Solo outputs: each prompt alone, the longest length (shorter ones are
                # prefixes: greedy, EOS ignored).
                solo = {}
                for prompt in prompts:
                    solo[prompt] = await _completion_ids(
                        client, _good_body(prompt, MAX_TOKENS, False)
                    )
                    assert len(solo[prompt]) == MAX_TOKENS
                # Warm-up: every prompt at once, twice, streaming and not.
                await asyncio.gather(
                    *(
                        _completion_ids(client, _good_body(p, MAX_TOKENS, s))
                        for p in prompts * 2
                        for s in (False, True)
                    )
                )
                rss_warm = _rss_bytes(pids)
                remaining = [num_requests]
                started = time.monotonic()

                async def one_client(index: int) -> None:
                    leaves = index % 4 == 0  # a quarter of the clients go away at random
                    local = random.Random(rng.random())
                    while remaining[0] > 0:
                        remaining[0] -= 1
                        figures.requests += 1
                        await one_request(local, leaves)

                async def one_request(local: random.Random, leaves: bool) -> None:
                    if local.random() < 0.05:
                        body = dict(local.choice(BAD_BODIES))
                        path = "/v1/completions"
                        if isinstance(body["prompt"], str) and local.random() < 0.5:
                            path = "/v1/chat/completions"
                            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
                        content = json.dumps(body).encode()  # keeps lone surrogates escaped
                        response = await client.post(
                            path, content=content, headers={"Content-Type": "application/json"}
                        )
                        if 400 <= response.status_code < 500:
                            figures.bad_refused += 1
                        else:
                            figures.unexpected.append(f"bad body {body}: {response.status_code}")
                        return
                    prompt = local.choice(prompts)
                    max_tokens = local.randint(1, MAX_TOKENS)
                    body = _good_body(prompt, max_tokens, local.random() < 0.5)
                    task = asyncio.ensure_future(_completion_ids(client, body))
                    if leaves and local.random() < 0.5:
                        await asyncio.wait({task}, timeout=local.uniform(0.0, 1.5))
                        if not task.done():
                            task.cancel()  # closes the connection: the client went away
                            figures.disconnected += 1
                            try:
                                await task
                            except asyncio.CancelledError:
                                pass
                            return
                    try:
                        ids = await task
                    except Exception as exc:
                        figures.unexpected.append(f"good request failed: {exc!r}")
                        return
                    figures.good += 1
                    if ids != solo[prompt][:max_tokens]:
                        figures.mismatches.append(f"{prompt!r} x{max_tokens}: {ids}")

                await asyncio.gather(*(one_client(i) for i in range(num_clients)))
                duration = time.monotonic() - started
                return {"rss_warm": rss_warm, "duration_s": duration}

        result = asyncio.run(main())
        idle, waited = wait_for(server, engine_idle, 60)
        rss_after = _rss_bytes(pids)
        report = {
            "requests": figures.requests,
            "clients": num_clients,
            "good_completed": figures.good,
            "disconnected": figures.disconnected,
            "bad_refused": figures.bad_refused,
            "unexpected_errors": len(figures.unexpected),
            "output_mismatches": len(figures.mismatches),
            "idle_after_s": round(waited, 2),
            "rss_after_warmup_mib": round(result["rss_warm"] / 2**20, 1),
            "rss_after_mib": round(rss_after / 2**20, 1),
            "duration_s": round(result["duration_s"], 1),
        }
        print("SOAK", json.dumps(report))
        assert not figures.unexpected, figures.unexpected[:5]
        assert not figures.mismatches, figures.mismatches[:5]
        assert idle, "requests still running or waiting, or KV blocks still in use"
        assert figures.good + figures.disconnected + figures.bad_refused == num_requests
        assert rss_after <= 1.05 * result["rss_warm"], report
        assert server.proc.poll() is None
        assert "Traceback" not in server.log_text()
        return report
    finally:
        server.stop()


def test_soak_short():
    report = run_soak(num_requests=int(os.environ.get("MINIVLLM_SOAK_REQUESTS", 32)),
                      num_clients=8, num_prompts=4)  # fmt: skip
    assert report["good_completed"] > 0


@pytest.mark.slow
def test_soak_full():
    report = run_soak(num_requests=1000, num_clients=64)
    assert report["disconnected"] > 0 and report["bad_refused"] > 0
