#!/usr/bin/env python
"""What q8_0's refined outlier blocks cost the product alone (issue 49): the Q8_0 packed
product with (gguf_packed_matmul_refined, the online q8_0 mode's) and without
(gguf_packed_matmul, a Q8_0 GGUF file's) the second int8 pass over each row's block of
largest max|x|, interleaved in one process, best of --rounds alternating rounds, per
SmolLM2 layer shape and row count: time per call and the ratio refined / plain. Rows 1:
one stream's decode (memory-bound: should be ~1.00x); 128 and 256: the throughput
workload's decode steps and prompts (compute-bound: the pass's 1/18 shows).

    .venv/bin/python benchmarks/online_quant_refined.py [--rows 1,4,32,128,512]

Activations carry an outlier channel as the residual stream does (the refined block is
real work, not a block of zeros). Keep the machine quiet while it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from minivllm.kernels import gguf_kernels as gk  # noqa: E402
from tests.kernels.test_gguf_kernels import random_blocks  # noqa: E402

# SmolLM2-135M: q/k/v fused, o, gate/up fused, down, the tied LM head (out, in)
SHAPES = [
    ("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
    ("lm_head", 49152, 576),
]  # fmt: skip


def timed(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def call(refined: bool, qtype: int, packed: torch.Tensor, n: int, k: int, x, y):
    """One product, its arguments bound (as the model's layers call the kernel)."""
    kernel = gk.packed_matmul_kernel(refined)
    args = (qtype, packed.data_ptr(), n, k, x.data_ptr(), x.shape[0], y.data_ptr(), n)
    return lambda: kernel(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,4,32,128,512")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    qtype = gk.SUPPORTED_TYPES["Q8_0"]
    print(f"path {gk.packed_path()}, threads {torch.get_num_threads()}")
    for name, n, k in SHAPES:
        packed = gk.pack(torch.from_numpy(random_blocks("Q8_0", n, k)), qtype, k)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            x[:, 199 % k] = 35.0  # SmolLM2's outlier channel, ~40x the median
            y = torch.empty(m, n)
            calls = {refined: call(refined, qtype, packed, n, k, x, y) for refined in (False, True)}
            budget = 0.05  # seconds a timing
            repeat = max(1, int(budget / max(timed(calls[False], 1), 1e-6)))
            best = {False: float("inf"), True: float("inf")}
            for _ in range(args.rounds):
                for refined in (False, True):
                    best[refined] = min(best[refined], timed(calls[refined], repeat))
            print(
                f"{name:8s} n={n:6d} k={k:5d} rows={m:4d}  plain {1e6 * best[False]:9.1f} us"
                f"  refined {1e6 * best[True]:9.1f} us  {best[True] / best[False]:.3f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
