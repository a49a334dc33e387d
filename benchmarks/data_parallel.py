"""Issue 56, acceptance 4: two data-parallel engine cores on a shared-prefix workload
(several system prompts, many users each). The prefix cache hit rate with prefix-aware
balancing (MINIVLLM_DP_LOAD_BALANCING=prefix) should be at least 1.5x round robin's, and
the throughput at least 1.7x the best single core's where the machine has the cores for
two (else say the bound: two cores of N threads each cannot beat one core of 2N by more
than the scheduling overlap).

    .venv/bin/python benchmarks/data_parallel.py                 # bundled SmolLM2, 2 cores
    .venv/bin/python benchmarks/data_parallel.py --systems 8 --users 16 --kv-cache-gib 0.05
    RAY_ADDRESS=HEAD:6379 .venv/bin/python benchmarks/data_parallel.py --ray   # over nodes

Workload (defaults): --systems system prompts of --system-len random tokens, --users
requests each (a system prompt and a --user-len-token line of their own), shuffled, sent
through AsyncLLM with at most --concurrency in flight; --output-len greedy tokens each
(ignore_eos). Each engine's KV cache is --kv-cache-gib: the workload's system prompts
should not all fit one core's cache but fit two (the defaults: 4 x 512 tokens against
about 1,400 a core for the bundled model), so where a request lands matters. Runs, each on
fresh engines after a warm-up: one core (all the machine's threads), two cores with
round robin, two cores with prefix-aware balancing. Prints tokens/s and the prefix cache
hit rate (hit tokens over queried tokens, from each core's statistics) of each. With
--ray the two cores are Ray actors spread over the nodes of RAY_ADDRESS's cluster (or of a
local one), the one core a local process as before: one node's core against two nodes'.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

TOKEN_ID_RANGE = (1_000, 40_000)  # ordinary word pieces, no special tokens


def workload(args) -> list[list[int]]:
    rng = random.Random(0)

    def draw(n: int) -> list[int]:
        return [rng.randint(*TOKEN_ID_RANGE) for _ in range(n)]

    systems = [draw(args.system_len) for _ in range(args.systems)]
    prompts = [system + draw(args.user_len) for system in systems for _ in range(args.users)]
    rng.shuffle(prompts)
    return prompts


async def run(args, dp: int, balancing: str) -> dict:
    os.environ["MINIVLLM_DP_LOAD_BALANCING"] = balancing
    from minivllm import AsyncEngineArgs, AsyncLLM, SamplingParams

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=args.model,
            data_parallel_size=dp,
            distributed_executor_backend="ray" if args.ray and dp > 1 else None,
            max_model_len=args.system_len + args.user_len + args.output_len + 16,
            kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
            seed=0,
        )
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

        async def one(i: int, prompt: list[int]) -> int:
            tokens = 0
            async for out in engine.generate({"prompt_token_ids": prompt}, params, f"{dp}-{i}"):
                tokens = len(out.outputs[0].token_ids)
            return tokens

        await one(-1, [TOKEN_ID_RANGE[0]] * 8)  # warm-up
        before = await engine.get_engine_stats()
        limit = asyncio.Semaphore(args.concurrency)

        async def limited(i: int, prompt: list[int]) -> int:
            async with limit:
                return await one(i, prompt)

        prompts = workload(args)
        start = time.perf_counter()
        counts = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
        after = await engine.get_engine_stats()
    finally:
        engine.shutdown()
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before))
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before))
    return {"rate": sum(counts) / wall, "hit_rate": hits / queries if queries else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--systems", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=float, default=0.06)
    parser.add_argument(
        "--ray", action="store_true", help="the two cores as Ray actors, spread over nodes"
    )
    args = parser.parse_args()
    print(f"cores available: {len(os.sched_getaffinity(0))}")
    results = {}
    for label, dp, balancing in (
        ("one core", 1, "prefix"),
        ("two cores, round robin", 2, "round_robin"),
        ("two cores, prefix-aware", 2, "prefix"),
    ):
        r = results[label] = asyncio.run(run(args, dp, balancing))
        print(f"{label}: {r['rate']:.1f} tok/s, prefix cache hit rate {r['hit_rate']:.1%}")
    rr, prefix = results["two cores, round robin"], results["two cores, prefix-aware"]
    if rr["hit_rate"]:
        print(f"hit rate prefix-aware / round robin: {prefix['hit_rate'] / rr['hit_rate']:.2f}x")
    ratio = prefix["rate"] / results["one core"]["rate"]
    print(f"throughput two cores (prefix-aware) / one core: {ratio:.2f}x (target >= 1.7)")


if __name__ == "__main__":
    main()
