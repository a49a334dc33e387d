"""Soak (issue 20): many concurrent clients, streaming and not, random lengths, a quarter of
the clients going away at random moments, bad requests mixed in. Afterwards nothing runs or
waits, no KV block is in use, RSS is back near its post-warm-up level, and every good
request's greedy output is the one it gets when run alone.

The warm-up runs one prompt of each length up to 256 tokens (oneDNN caches state per GEMM
shape, up to a bound: this fills it), writes every KV block once (the CPU cache's pages are
resident from their first write), and then the soak's own mix at full concurrency; the
soak itself runs in two halves, RSS taken after each, so a leak fails both the issue's 5%
bound and the second half's own.

The full run (1,000 requests, 64 clients) is marked slow and prints its figures:
    .venv/bin/python -m pytest -m slow -s tests/entrypoints/openai/test_soak.py
A short one runs in `make test`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
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
    idle_after_s: float = 0.0  # after the last round, until 0 running, waiting, KV in use


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _rss(pids: dict[str, int]) -> dict[str, float]:
    """RSS in MiB of each process (frontend, engine core) and their sum."""
    rss = {name: _rss_mib(pid) for name, pid in pids.items()}
    return {**rss, "total": sum(rss.values())}


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


async def _sweep_batch_sizes(client: httpx.AsyncClient, max_tokens_in_step: int) -> None:
    """One request after another with a prompt of every length up to max_tokens_in_step
    (distinct first tokens: no prefix-cache hit shortens a step).

    The engine core keeps native state per GEMM shape: a step with a token count not seen
    before adds ~2 MB, about half of it oneDNN's primitive cache (an LRU of 1,024 entries,
    one per linear layer shape: 4 here, so 256 lengths fill it), the rest below torch's
    linear too. Without this sweep the soak's RSS kept growing, ever more slowly, as rarer
    step sizes turned up; the same lengths run again add nothing: caches, not a leak."""
    for length in range(1, max_tokens_in_step + 1):
        ids = [100 + (length * 7919 + j * 31) % 40000 for j in range(length)]
        response = await client.post(
            "/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0}
        )
        response.raise_for_status()


async def _touch_every_kv_block(client: httpx.AsyncClient, prompt_len: int = 496) -> int:
    """Prompts of distinct tokens (no prefix-cache hits), max_tokens 1, until the engine has
    handed out more blocks than its KV cache has: every block written once.

    The CPU KV cache's pages are zeroed by the kernel and resident from their first write,
    and the free queue hands out the least recently used block: without this a soak keeps
    taking first touches of blocks it never used, which reads as growth. Returns the number
    of blocks."""
    metrics = (await client.get("/metrics")).text
    info = re.search(r"vllm:cache_config_info\{([^}]*)\}", metrics).group(1)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    num_blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    blocks_per_prompt = -(-prompt_len // block_size)

    async def one(index: int) -> None:
        ids = [100 + (index * 7907 + j * 53) % 40000 for j in range(prompt_len)]
        response = await client.post(
            "/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0}
        )
        response.raise_for_status()

    count = num_blocks // blocks_per_prompt + 2
    for first in range(0, count, 4):
        await asyncio.gather(*(one(i) for i in range(first, min(first + 4, count))))
    return num_blocks


def run_soak(
    num_requests: int,
    num_clients: int,
    num_prompts: int = len(PROMPTS),
    seed: int = 0,
    warmup_requests: int = 0,
    sweep_tokens: int = 0,
) -> dict:
    """Solo outputs; a warm-up (batch-size sweep, then warmup_requests of the soak's own mix
    at full concurrency); then num_requests in two halves, RSS taken after each, idle."""
    rng = random.Random(seed)
    prompts = PROMPTS[:num_prompts]
    server = RemoteServer(["--max-model-len", "512", "--log-stats-interval", "30"])
    try:
        pids = {"frontend": server.proc.pid, "engine_core": server.engine_core_pid()}
        figures = Figures()
        warmup = Figures()

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

                async def one_round(count: int, figs: Figures) -> None:
                    remaining = [count]

                    async def one_client(index: int) -> None:
                        leaves = index % 4 == 0  # a quarter of the clients go away at random
                        local = random.Random(rng.random())
                        while remaining[0] > 0:
                            remaining[0] -= 1
                            figs.requests += 1
                            await one_request(local, leaves, figs)

                    await asyncio.gather(*(one_client(i) for i in range(num_clients)))
                    idle, waited = await asyncio.to_thread(wait_for, server, engine_idle, 60)
                    assert idle, "requests still running or waiting, or KV blocks in use"
                    figs.idle_after_s = waited

                async def one_request(local: random.Random, leaves: bool, figs: Figures) -> None:
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
                            figs.bad_refused += 1
                        else:
                            figs.unexpected.append(f"bad body {body}: {response.status_code}")
                        return
                    prompt = local.choice(prompts)
                    max_tokens = local.randint(1, MAX_TOKENS)
                    body = _good_body(prompt, max_tokens, local.random() < 0.5)
                    task = asyncio.ensure_future(_completion_ids(client, body))
                    if leaves and local.random() < 0.5:
                        await asyncio.wait({task}, timeout=local.uniform(0.0, 1.5))
                        if not task.done():
                            task.cancel()  # closes the connection: the client went away
                            figs.disconnected += 1
                            try:
                                await task
                            except asyncio.CancelledError:
                                pass
                            return
                    try:
                        ids = await task
                    except Exception as exc:
                        figs.unexpected.append(f"good request failed: {exc!r}")
                        return
                    figs.good += 1
                    if ids != solo[prompt][:max_tokens]:
                        figs.mismatches.append(f"{prompt!r} x{max_tokens}: {ids}")

                # Warm-up: every batch size the soak can make, then its own mix, so that
                # the RSS bound measures what the soak leaks, not what it touches first.
                await _sweep_batch_sizes(client, sweep_tokens)
                await _touch_every_kv_block(client)
                await one_round(warmup_requests, warmup)
                rss = {"warm": _rss(pids)}
                started = time.monotonic()
                await one_round(num_requests // 2, figures)
                rss["half"] = _rss(pids)
                await one_round(num_requests - num_requests // 2, figures)
                rss["after"] = _rss(pids)
                return {"rss": rss, "duration_s": time.monotonic() - started}

        result = asyncio.run(main())
        rss = result["rss"]
        warm, half, after = rss["warm"]["total"], rss["half"]["total"], rss["after"]["total"]
        report = {
            "requests": figures.requests,
            "clients": num_clients,
            "good_completed": figures.good,
            "disconnected": figures.disconnected,
            "bad_refused": figures.bad_refused,
            "unexpected_errors": len(figures.unexpected) + len(warmup.unexpected),
            "output_mismatches": len(figures.mismatches) + len(warmup.mismatches),
            "idle_after_s": round(figures.idle_after_s, 2),
            "warmup_requests": warmup.requests,
            "sweep_tokens": sweep_tokens,
            "rss_mib": {k: {n: round(v, 1) for n, v in r.items()} for k, r in rss.items()},
            "rss_after_vs_warm_pct": round(100 * (after / warm - 1), 2),
            "rss_second_half_pct": round(100 * (after / half - 1), 2),
            "duration_s": round(result["duration_s"], 1),
        }
        print("SOAK", json.dumps(report))
        assert not figures.unexpected + warmup.unexpected, figures.unexpected[:5]
        assert not figures.mismatches + warmup.mismatches, figures.mismatches[:5]
        assert figures.good + figures.disconnected + figures.bad_refused == num_requests
        # Nothing leaked: within 5% of the post-warm-up level (the bound), and a
        # steady leak would show in the second half alone too (its growth under 2%).
        assert after <= 1.05 * warm, report
        assert after <= 1.02 * half, report
        assert server.proc.poll() is None
        assert "Traceback" not in server.log_text()
        return report
    finally:
        server.stop()


def test_soak_short():
    report = run_soak(
        num_requests=int(os.environ.get("MINIVLLM_SOAK_REQUESTS", 32)),
        num_clients=8,
        num_prompts=4,
        warmup_requests=16,
        sweep_tokens=16,
    )
    assert report["good_completed"] > 0


@pytest.mark.slow
def test_soak_full():
    report = run_soak(num_requests=1000, num_clients=64, warmup_requests=200, sweep_tokens=256)
    assert report["disconnected"] > 0 and report["bad_refused"] > 0
