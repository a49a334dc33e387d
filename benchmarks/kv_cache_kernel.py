"""The C paged-attention kernel alone over each --kv-cache-dtype's cache (issue #53): one
decode row over a long context, the bundled SmolLM2's attention shape (9 query heads, 3 KV
heads of 64, 30 layers), the dtypes alternating run by run; medians of each dtype's steps.
It isolates the cache read from the rest of a decode step (benchmarks/kv_cache_speed.sh
measures the whole step). Run on a quiet machine; with fewer free cores than threads the
OpenMP threads wait on each other and the figures mean nothing.

    .venv/bin/python benchmarks/kv_cache_kernel.py                       # 8,064 tokens
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_cache_kernel.py --dtypes auto,int8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm.attention.cpu import CPUAttentionBackend, kv_views
from minivllm.kernels.cpu_kernels import paged_attention, write_kv


def build(name: str, args, k: torch.Tensor, v: torch.Tensor):
    """The backend and each layer's (keys, values) views, every context token written."""
    backend = CPUAttentionBackend(16, kv_cache_dtype=name)
    if backend.kernels is None or backend.write_kernel is None:
        raise SystemExit("the C kernels could not be built")
    num_blocks = -(-args.context // 16)

    def zeros(shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    layers = []
    for _ in range(args.layers):
        cache = backend.new_kv_cache(
            zeros, num_blocks, 16, args.kv_heads, args.head_dim, torch.float32
        )
        keys, values = kv_views(cache, backend.kv_format)
        slots = torch.arange(args.context)
        write_kv(backend.write_kernel, k, v, keys, values, slots, backend.kv_format.code)
        layers.append((keys, values))
    return backend, layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", default="auto,int8,int8k_int8v,fp8")
    parser.add_argument("--context", type=int, default=8064)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, args.context, args.kv_heads, args.head_dim, generator=g)
    q = torch.randn(1, args.heads, args.head_dim, generator=g)
    names = args.dtypes.split(",")
    setups = {name: build(name, args, k, v) for name in names}
    table = torch.arange(-(-args.context // 16)).view(1, -1)
    lens = torch.tensor([args.context])

    def step(name: str) -> float:
        backend, layers = setups[name]
        start = time.perf_counter()
        for keys, values in layers:
            code = backend.kv_format.code
            paged_attention(backend.kernels, q, keys, values, table, lens, 0.125, kv_type=code)
        return (time.perf_counter() - start) * 1e3

    for name in names:  # warm up
        step(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for run in range(args.runs):
        for name in names if run % 2 == 0 else names[::-1]:
            times[name].append(step(name))
    base = statistics.median(times[names[0]])
    for name in names:
        median = statistics.median(times[name])
        runs = ", ".join(f"{t:.1f}" for t in times[name])
        print(f"{name}: median {median:.2f} ms a step ({base / median:.2f}x {names[0]}); {runs}")


if __name__ == "__main__":
    main()
