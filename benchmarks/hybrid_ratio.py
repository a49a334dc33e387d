"""Issue 50's 4k ratio without llama.cpp between the two rates: one stream's decode after a
4,096-token prompt, then right after it one after a 128-token prompt (the 4k prompt's ~7 s of
prefill before the pair, not inside it, as gguf_hybrid_shape.py pairs them since 78f48ed), in
one in-process engine with that script's --vs-llamacpp settings: each pair's 4k / 128 rate
and the pairs' median. With --time-attention the engine runs eagerly (no CPU graphs) and each
context's attention calls are timed (attention/cpu.py's paged_attention), median us a call.

The host's memory speed can flip within a minute (BENCHMARKS.md): compare two trees by running
this from each checkout in turn, several times, and comparing the pairs' medians.

    .venv/bin/python benchmarks/hybrid_ratio.py /tmp/gguf3-lfm2-q4.gguf --pairs 4
    .venv/bin/python benchmarks/hybrid_ratio.py /tmp/gguf3-lfm2-q4.gguf --time-attention
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MINIVLLM_CPU_THREADS_FOLLOW_LOAD", "0")  # the count asked, throughout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf", help="a file gguf_hybrid_shape.py wrote")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--decode", type=int, default=64, help="tokens decoded a request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="int8k_int8v")
    parser.add_argument("--time-attention", action="store_true")
    args = parser.parse_args()
    if args.time_attention:
        os.environ["MINIVLLM_CPU_GRAPHS"] = "0"  # graphs replay the kernel from C: no wrapper

    from gguf_hybrid_shape import hybrid_engine, minivllm_rates, torch_threads

    import minivllm.attention.cpu as cpu_attention

    calls: list[float] = []
    if args.time_attention:
        plain = cpu_attention.paged_attention

        def timed(*a, **k):
            start = time.perf_counter()
            out = plain(*a, **k)
            calls.append(time.perf_counter() - start)
            return out

        cpu_attention.paged_attention = timed

    torch_threads(args.threads)
    llm = hybrid_engine(args.gguf, args.decode, args.kv_cache_dtype)
    minivllm_rates(llm, 128, 4)  # warm-up

    def decode_rate(context: int) -> tuple[float, float]:
        calls.clear()
        rate = minivllm_rates(llm, context, args.decode)[1]
        # (the prompt's few calls among the decode's hundreds: the median is the decode's)
        return rate, statistics.median(calls) * 1e6 if calls else float("nan")

    ratios = []
    for i in range(args.pairs):
        (r4k, a4k), (r128, a128) = decode_rate(4096), decode_rate(128)
        ratios.append(r4k / r128)
        line = f"pair {i + 1}: decode @4096 {r4k:.1f}, @128 {r128:.1f} tok/s: {r4k / r128:.3f}"
        if args.time_attention:
            line += f"; attention call @4096 {a4k:.0f} us, @128 {a128:.0f} us"
        print(line, flush=True)
    print(f"median of the pairs' ratios: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
