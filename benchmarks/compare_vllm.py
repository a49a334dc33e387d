"""Run minivllm and vLLM's CPU build alternately on the same workload; print the ratio.

Both load the same float32 HF directory (prepare_model.py). vLLM runs from its own
virtualenv (default ~/peer-vllm, see ../shared/BENCHMARKING.md) with both cores bound;
nothing is installed into the project's environment.

    python benchmarks/compare_vllm.py throughput --pairs 3
    python benchmarks/compare_vllm.py latency --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from prepare_model import prepare  # noqa: E402

PEER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}
WORKLOADS = {
    # name: (bench args, json key, higher is better)
    "throughput": (
        [
            "throughput",
            "--dataset-name",
            "random",
            "--input-len",
            "128",
            "--output-len",
            "128",
            "--num-prompts",
            "256",
        ],
        "output_tokens_per_second",
        True,
    ),
    "latency": (
        [
            "latency",
            "--input-len",
            "128",
            "--output-len",
            "128",
            "--batch-size",
            "1",
            "--num-iters-warmup",
            "1",
            "--num-iters",
            "5",
        ],
        "avg_latency",
        False,
    ),
}


def run(engine: str, workload: str, model: str, peer: str) -> tuple[float, float]:
    """(figure, wall seconds including start-up) of one run of one engine."""
    args, key, _ = WORKLOADS[workload]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    if engine == "minivllm":
        cmd = [
            sys.executable,
            "-m",
            "minivllm.bench",
            *args,
            "--model",
            model,
            "--no-enable-prefix-caching",
            "--output-json",
            out,
        ]
        env = dict(os.environ)
    else:
        cmd = [
            os.path.join(peer, "bin", "vllm"),
            "bench",
            *args,
            "--model",
            model,
            "--dtype",
            "float32",
            "--no-enable-prefix-caching",
            "--output-json",
            out,
        ]
        env = {**os.environ, **PEER_ENV}
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    with open(out) as f:
        return json.load(f)[key], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--peer", default=os.path.expanduser("~/peer-vllm"))
    parser.add_argument("--model", default=None, help="HF dir (default: prepared SmolLM2 fp32)")
    args = parser.parse_args()
    model = args.model or prepare()
    _, key, higher_is_better = WORKLOADS[args.workload]
    figures = {"minivllm": [], "vllm": []}
    for i in range(args.pairs):
        for engine in ("minivllm", "vllm"):
            value, wall = run(engine, args.workload, model, args.peer)
            figures[engine].append(value)
            print(
                f"pair {i + 1} {engine:8s} {key} = {value:.3f}  (run took {wall:.0f} s)", flush=True
            )
    ours, theirs = (statistics.median(figures[e]) for e in ("minivllm", "vllm"))
    ratio = ours / theirs if higher_is_better else theirs / ours
    print(
        f"median {key}: minivllm {ours:.3f}, vLLM {theirs:.3f}; "
        f"minivllm is {ratio:.2f}x vLLM (higher is better)"
    )


if __name__ == "__main__":
    main()
