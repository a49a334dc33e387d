"""`minivllm bench latency`: end-to-end latency of one batch, plus TTFT and TPOT."""

from __future__ import annotations

import argparse
import statistics
import time

from minivllm.bench.common import add_engine_args, engine_kwargs, print_header, write_json
from minivllm.bench.datasets import random_token_prompts


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--output-json", default=None)


def _run_once(engine, prompts, params, tag: str) -> tuple[float, float, float]:
    """(latency, time to first token, time per output token after the first) of one batch."""
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    first = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and any(o.outputs[0].token_ids for o in outputs):
            first = time.perf_counter()
    end = time.perf_counter()
    tpot = (end - first) / max(params.max_tokens - 1, 1)
    return end - start, first - start, tpot


def main(args: argparse.Namespace) -> dict:
    from minivllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.llm_engine
    prompts = random_token_prompts(
        llm.get_tokenizer(), args.batch_size, args.input_len, seed=args.seed
    )
    # vLLM's harness samples at temperature 1.0; the same workload on both engines.
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    for i in range(args.num_iters_warmup):
        _run_once(engine, prompts, params, f"warmup{i}")
    runs = [_run_once(engine, prompts, params, f"iter{i}") for i in range(args.num_iters)]
    latencies, ttfts, tpots = zip(*runs)
    results = {
        "avg_latency": statistics.mean(latencies),
        "latencies": list(latencies),
        "median_ttft_ms": statistics.median(ttfts) * 1000,
        "median_tpot_ms": statistics.median(tpots) * 1000,
        "ttfts_ms": [t * 1000 for t in ttfts],
        "tpots_ms": [t * 1000 for t in tpots],
    }
    results["device"] = print_header("Latency Benchmark Result", engine.vllm_config.device)
    print(f"Avg latency: {results['avg_latency']:.4f} seconds")
    print(f"Median TTFT: {results['median_ttft_ms']:.2f} ms")
    print(
        f"Median TPOT: {results['median_tpot_ms']:.2f} ms "
        f"({1000 / results['median_tpot_ms']:.1f} output tokens/s per stream)"
    )
    write_json(args.output_json, results)
    return results
