"""Prompt-heavy offline throughput, minivllm against vLLM's CPU build (issue 19, acceptance 2):
128 requests of 256-1024 random tokens (uniform, seeded), 32 output tokens each, one
generate() call; output tokens/s, alternating engines, medians over the pairs.

Both engines run this same file through their own `LLM` class (minivllm keeps vLLM's API):
the project's venv imports minivllm, the peer's venv (default ~/peer-vllm) imports vllm, with
the same token ids, sampling parameters (temperature 1.0, ignore_eos, as `vllm bench
throughput`), prefix caching off and each engine's other defaults (vLLM's CPU build: 4,096
batched tokens for the LLM class; minivllm: 2,048). A short generate() warms each engine up
outside the timed call.

    .venv/bin/python benchmarks/prompt_heavy.py --pairs 3
    .venv/bin/python benchmarks/prompt_heavy.py --run minivllm   # one run, prints JSON
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
RESULT = "RESULT "


def make_prompts(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids (away from the special ids at both ends of the vocabulary)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(low, high))] for _ in range(n)
    ]


def run_one(engine: str, model: str, args: argparse.Namespace) -> dict:
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model, dtype="float32", enable_prefix_caching=False)
    else:
        from minivllm import LLM, SamplingParams

        llm = LLM(model, enable_prefix_caching=False)
    vocab = len(llm.get_tokenizer())
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=2))
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "engine": engine,
        "elapsed_time": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_second": output_tokens / elapsed,
        "total_tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
    }


def spawn(engine: str, model: str, args: argparse.Namespace) -> dict:
    from compare_vllm import PEER_ENV

    python = os.path.join(args.peer, "bin", "python") if engine == "vllm" else sys.executable
    env = {**os.environ, **PEER_ENV} if engine == "vllm" else dict(os.environ)
    cmd = [python, os.path.abspath(__file__), "--run", engine, "--model", model]
    cmd += ["--num-prompts", str(args.num_prompts), "--min-len", str(args.min_len)]
    cmd += ["--max-len", str(args.max_len), "--output-len", str(args.output_len)]
    cmd += ["--seed", str(args.seed)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} run failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    # vLLM logs to stdout too: the result is the line that starts with the marker.
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith(RESULT))
    return json.loads(line[len(RESULT) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--run", choices=["minivllm", "vllm"], help="one run of one engine")
    parser.add_argument("--model", default=None, help="HF directory (default: prepare_model)")
    parser.add_argument("--peer", default=os.path.expanduser("~/peer-vllm"))
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.model is None:
        from prepare_model import prepare

        args.model = prepare()
    if args.run:
        print(RESULT + json.dumps(run_one(args.run, args.model, args)), flush=True)
        return
    runs: dict[str, list[float]] = {"minivllm": [], "vllm": []}
    for i in range(args.pairs):
        for engine in ("minivllm", "vllm"):
            result = spawn(engine, args.model, args)
            runs[engine].append(result["output_tokens_per_second"])
            print(
                f"pair {i + 1} {engine:8s} {result['output_tokens_per_second']:8.1f} output tok/s"
                f"  {result['total_tokens_per_second']:8.1f} total tok/s"
                f"  {result['elapsed_time']:6.1f} s",
                flush=True,
            )
    mini, peer = statistics.median(runs["minivllm"]), statistics.median(runs["vllm"])
    print(f"median output tok/s: minivllm {mini:.1f}, vLLM {peer:.1f}, ratio {mini / peer:.3f}")


if __name__ == "__main__":
    main()
