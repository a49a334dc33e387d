"""`minivllm bench serve`: load an OpenAI-compatible server and report latency as vLLM does.

Sends --num-prompts streaming requests (random token-id prompts of --random-input-len,
--random-output-len tokens each with ignore_eos, greedy) to --base-url, arriving as a
Poisson process at --request-rate (inf: all at once), at most --max-concurrency in
flight. Reports TTFT, TPOT (excluding the first token), ITL and end-to-end latency (mean,
median, p99) and the token throughputs, with vLLM's output lines and JSON keys, so the
same command line can be pointed at `minivllm serve` or `vllm serve`. --goodput ttft:MS
tpot:MS e2el:MS also reports vLLM's request goodput: completed requests per second that met
every one of those targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from minivllm.bench.common import write_json


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--backend", default="openai", choices=["openai", "vllm"])
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--tokenizer", default=None, help="local tokenizer for the random ids")
    parser.add_argument("--dataset-name", default="random", choices=["random"])
    parser.add_argument("--random-input-len", "--input-len", type=int, default=128)
    parser.add_argument("--random-output-len", "--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--output-json", "--result-filename", dest="output_json", default=None)
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="Targets, in milliseconds, a request must all meet to count toward goodput (as "
        "vLLM's): ttft, tpot (mean time per output token after the first), e2el; e.g. "
        "--goodput ttft:1000 tpot:50",
    )


GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """--goodput's KEY:MS pairs, as a dict of milliseconds (vLLM's keys and checks)."""
    targets: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(
                f"--goodput takes KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}; got {item!r}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: the target must not be negative")
        targets[key] = ms
    return targets


def request_tpot(result: RequestResult) -> float:
    """vLLM's per-request TPOT: the time after the first token over the tokens after it."""
    if result.output_tokens > 1:
        return (result.e2e - result.ttft) / (result.output_tokens - 1)
    return 0.0


def meets_targets(result: RequestResult, targets: dict[str, float]) -> bool:
    """A completed request within every target (milliseconds) of --goodput."""
    measured = {"ttft": result.ttft, "tpot": request_tpot(result), "e2el": result.e2e}
    return result.ok and all(measured[k] * 1e3 <= ms for k, ms in targets.items())


async def _one_request(client, url: str, payload: dict, headers: dict) -> RequestResult:
    result = RequestResult(prompt_len=len(payload["prompt"]))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue  # as vLLM's client: a chunk with a choice is a token's, even
                    # when its text is empty (a special token, half a UTF-8 character)
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = True
    except Exception as err:  # a failed request is counted and reported, not fatal
        result.error = f"{type(err).__name__}: {err}"
    return result


def _base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def _headers(args: argparse.Namespace) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _percentiles(values: list[float]) -> tuple[float, float, float]:
    """(mean, median, p99) in milliseconds."""
    if not values:
        return 0.0, 0.0, 0.0
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return statistics.mean(values) * 1e3, statistics.median(values) * 1e3, p99 * 1e3


async def _run(args: argparse.Namespace, prompts: list[list[int]], model: str) -> dict:
    import httpx

    url = _base_url(args) + args.endpoint
    headers = _headers(args)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    rng = random.Random(args.seed)

    async def limited(client, payload):
        async with limit:
            return await _one_request(client, url, payload, headers)

    timeout = httpx.Timeout(None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            payload = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.random_output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            tasks.append(asyncio.create_task(limited(client, payload)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return _summarize(args, results, duration)


def _summarize(args: argparse.Namespace, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    for r in ok:
        r.output_tokens = r.output_tokens or len(r.itl) + 1
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [request_tpot(r) for r in ok if r.output_tokens > 1]
    summary = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:10],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    targets = parse_goodput(getattr(args, "goodput", None))
    if targets:
        good = sum(meets_targets(r, targets) for r in ok)
        summary["request_goodput"] = good / duration
        summary["goodput_targets_ms"] = targets
    metrics = {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2e for r in ok],
    }
    for name, values in metrics.items():
        mean, median, p99 = _percentiles(values)
        summary[f"mean_{name}_ms"] = mean
        summary[f"median_{name}_ms"] = median
        summary[f"p99_{name}_ms"] = p99
    return summary


def _print(summary: dict) -> None:
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    rows = [
        ("Successful requests:", summary["completed"]),
        ("Failed requests:", summary["failed"]),
        ("Benchmark duration (s):", f"{summary['duration']:.2f}"),
        ("Total input tokens:", summary["total_input_tokens"]),
        ("Total generated tokens:", summary["total_output_tokens"]),
        ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}"),
    ]
    if "request_goodput" in summary:
        rows.insert(6, ("Request goodput (req/s):", f"{summary['request_goodput']:.2f}"))
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        print("{s:{c}^50}".format(s=title, c="-"))
        upper = name.upper()
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {upper} (ms):"
            print(f"{label:<40}{summary[f'{stat}_{name}_ms']:<10.2f}")
    print("=" * 50)
    for error in summary["errors"]:
        print(f"error: {error}")


def _server_model(args: argparse.Namespace) -> str:
    import httpx

    url = _base_url(args) + "/v1/models"
    models = httpx.get(url, headers=_headers(args), timeout=30).json()
    return models["data"][0]["id"]


def main(args: argparse.Namespace) -> dict:
    from minivllm.bench.datasets import random_token_prompts
    from minivllm.model.loader import default_model_path
    from minivllm.tokenizer import load_tokenizer

    if args.num_prompts < 1 or args.request_rate <= 0:
        raise ValueError("--num-prompts and --request-rate must be positive")
    parse_goodput(args.goodput)  # a bad target fails before any request
    model = args.model or _server_model(args)
    # The random ids come from the served model's vocabulary when it is a local path.
    local = model if os.path.exists(model) else None
    tokenizer = load_tokenizer(args.tokenizer or local or default_model_path())
    prompts = random_token_prompts(
        tokenizer, args.num_prompts, args.random_input_len, seed=args.seed
    )
    summary = asyncio.run(_run(args, prompts, model))
    _print(summary)
    write_json(args.output_json, summary)
    return summary
