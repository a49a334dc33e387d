"""Prefix caching on a shared-prefix workload, and its cost when nothing is shared.

Workload (defaults): 64 requests, each a 1,024-token prefix shared by all of them plus 32
unique tokens (random token ids), 16 greedy output tokens with ignore_eos; the control
workload gives every request 1,056 unique tokens. Each (workload, caching) pair runs on a
fresh engine (the bundled SmolLM2-135M-Instruct in fp32) after a warm-up request; all
requests are added at once and the engine is stepped by hand, so the time to first
token is measured per request from that moment. The KV pool holds every request at
once, so there is no preemption with caching off either.

    .venv/bin/python benchmarks/shared_prefix.py [--json results.json]
    .venv/bin/python benchmarks/shared_prefix.py --workloads unshared --repeats 3

With --repeats N each workload runs off, on, off, on, ... N times each, and the on/off
ratios are taken between the medians.

It also times the scheduler-side bookkeeping of prefix caching alone (hashing, lookups,
the free queue) on the control workload, with no model: a figure the machine's noise
does not drown.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from minivllm import LLM, SamplingParams
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request

# SmolLM2-135M in fp32: 30 layers x (K and V) x 3 KV heads x 64 dims x 4 bytes per token.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
TOKEN_ID_RANGE = (1_000, 40_000)  # ordinary word pieces, no special tokens


def make_prompts(args, shared: bool, seed: int) -> list[list[int]]:
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randint(*TOKEN_ID_RANGE) for _ in range(n)]

    total = args.prefix_len + args.suffix_len
    if shared:
        prefix = draw(args.prefix_len)
        return [prefix + draw(args.suffix_len) for _ in range(args.num_requests)]
    return [draw(total) for _ in range(args.num_requests)]


def run_one(args, prompts: list[list[int]], caching: bool) -> dict:
    block_size = args.block_size
    seq_len = args.prefix_len + args.suffix_len + args.output_len
    blocks = args.num_requests * -(-seq_len // block_size) + 64  # everyone fits at once
    llm = LLM(
        dtype="float32",
        block_size=block_size,
        enable_prefix_caching=caching,
        max_model_len=seq_len + block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes
        or blocks * block_size * KV_BYTES_PER_TOKEN,
    )
    engine = llm.llm_engine
    try:
        # Warm-up, outside the figures, on tokens no workload uses.
        warm = random.Random(-1)
        warm_prompt = [warm.randint(*TOKEN_ID_RANGE) for _ in range(64)]
        llm.generate(
            {"prompt_token_ids": warm_prompt}, SamplingParams(max_tokens=2), use_tqdm=False
        )
        stats_before = engine.last_stats

        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        first_token: dict[str, float] = {}
        outputs = {}
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(f"req-{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if out.outputs[0].token_ids and out.request_id not in first_token:
                    first_token[out.request_id] = now - start
                if out.finished:
                    outputs[out.request_id] = out
        elapsed = time.perf_counter() - start
        stats = engine.last_stats
    finally:
        engine.shutdown()

    assert len(outputs) == len(prompts)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs.values())
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    assert output_tokens == len(prompts) * args.output_len
    ttfts = sorted(first_token.values())
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "mean_ttft_s": statistics.fmean(ttfts),
        "median_ttft_s": statistics.median(ttfts),
        "max_ttft_s": ttfts[-1],
        "prefix_cache_queries": stats.prefix_cache_queries - stats_before.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits - stats_before.prefix_cache_hits,
        "num_preemptions": stats.num_preemptions - stats_before.num_preemptions,
        "output_token_ids": [outputs[f"req-{i}"].outputs[0].token_ids for i in range(len(prompts))],
    }


def time_bookkeeping(args, prompts: list[list[int]], caching: bool, repeat: int = 5) -> float:
    """Seconds of KV cache bookkeeping for the whole workload: admit, decode, free."""
    block_size = args.block_size
    seq_len = args.prefix_len + args.suffix_len + args.output_len
    num_blocks = args.num_requests * -(-seq_len // block_size) + 64
    best = float("inf")
    for _ in range(repeat):
        kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        requests = [Request(f"r{i}", list(p), params, None) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        for r in requests:
            hit_blocks, num_hit = kv.get_computed_blocks(r)
            assert kv.allocate_slots(r, r.num_tokens - num_hit, hit_blocks, num_hit) is not None
            kv.record_prefix_cache_stats(r, num_hit)
            r.num_computed_tokens = r.num_tokens
        for _ in range(args.output_len):
            for r in requests:
                r.append_output_token_ids([7])
                assert kv.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
        for r in requests:
            kv.free(r)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each")
    parser.add_argument("--workloads", default="shared,unshared")
    args = parser.parse_args()

    results: dict = {"args": vars(args), "machine": platform.platform()}
    print(
        f"{args.num_requests} requests x ({args.prefix_len} shared + {args.suffix_len} unique "
        f"tokens) -> {args.output_len} tokens; control: {args.prefix_len + args.suffix_len} "
        "unique tokens each"
    )
    header = (
        f"{'workload':<10} {'caching':<8} {'time s':>8} {'req/s':>7} {'tok/s':>8} "
        f"{'out tok/s':>9} {'mean TTFT s':>11} {'hit rate':>8} {'preempt':>7}"
    )
    print(header)
    for workload in args.workloads.split(","):
        prompts = make_prompts(args, workload == "shared", args.seed)
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):
            for caching in (False, True):
                r = run_one(args, prompts, caching)
                runs[caching].append(r)
                hit_rate = r["prefix_cache_hits"] / r["prefix_cache_queries"] if caching else 0.0
                print(
                    f"{workload:<10} {'on' if caching else 'off':<8} {r['elapsed_s']:8.2f} "
                    f"{r['requests_per_s']:7.3f} {r['total_tokens_per_s']:8.1f} "
                    f"{r['output_tokens_per_s']:9.2f} {r['mean_ttft_s']:11.2f} {hit_rate:8.1%} "
                    f"{r['num_preemptions']:7d}",
                    flush=True,
                )
        for caching in (False, True):
            results[f"{workload}/{'on' if caching else 'off'}"] = runs[caching]
        same = all(
            r["output_token_ids"] == runs[False][0]["output_token_ids"]
            for r in runs[False] + runs[True]
        )
        med = {
            (caching, key): statistics.median(r[key] for r in runs[caching])
            for caching in (False, True)
            for key in ("requests_per_s", "mean_ttft_s")
        }
        speedup = med[True, "requests_per_s"] / med[False, "requests_per_s"]
        ttft_ratio = med[True, "mean_ttft_s"] / med[False, "mean_ttft_s"]
        print(
            f"  {workload}: on/off (medians of {args.repeats}): throughput x{speedup:.3f}, "
            f"mean TTFT x{ttft_ratio:.3f}; greedy outputs identical: {same}"
        )
        results[f"{workload}/identical_outputs"] = same

    if "unshared/off" in results:
        control = make_prompts(args, False, args.seed)
        cost_on = time_bookkeeping(args, control, True)
        cost_off = time_bookkeeping(args, control, False)
        results["bookkeeping_s"] = {"on": cost_on, "off": cost_off}
        elapsed_off = statistics.median(r["elapsed_s"] for r in results["unshared/off"])
        print(
            f"KV cache bookkeeping for the control workload: {cost_on * 1e3:.1f} ms with "
            f"caching, {cost_off * 1e3:.1f} ms without: "
            f"+{(cost_on - cost_off) / elapsed_off:.3%} of the run"
        )
    if args.json:
        for value in results.values():
            for run in value if isinstance(value, list) else []:
                run.pop("output_token_ids", None)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
