#!/usr/bin/env python
"""The GGUF int8 products against another revision's kernel source, interleaved in one
process (this machine swings between two speed modes; runs alternating in separate
processes blur 10-20%): Gops/s, best of 8 alternating rounds, per type, shape and row count.

    python benchmarks/gguf_products.py --base REV [--variant native|avx2] [--rows 1,4,128]

--variant avx2 builds both without AVX-512 (the kernels for CPUs without it). Shapes are
Qwen2.5-0.5B's and SmolLM2's (the types its GGUF files use for them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from revision_source import kernel_source, source_at  # noqa: E402

from minivllm.kernels import gguf_kernels as gk  # noqa: E402
from tests.kernels.test_gguf_kernels import random_blocks  # noqa: E402

SHAPES = [
    ("Q5_0", 9728, 896), ("Q6_K", 896, 4864), ("Q4_K", 896, 4864), ("Q8_0", 1152, 896),
    ("Q4_0", 4864, 896), ("IQ4_NL", 4864, 896), ("Q3_K", 4864, 1024), ("Q4_1", 1536, 576),
]  # fmt: skip


def build(source: str | None, flags: tuple[str, ...]):
    with kernel_source(gk, source, gk._load_gguf_kernels):
        return gk.load_gguf_kernels(flags)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="git revision of the kernel to compare")
    parser.add_argument("--variant", choices=["native", "avx2"], default="native")
    parser.add_argument("--rows", default="1,4,128")
    args = parser.parse_args()
    flags = ("-mno-avx512f",) if args.variant == "avx2" else ()
    base = source_at(args.base, "minivllm/kernels/gguf_kernels.c")
    libs = {"base": build(base, flags), "head": build(None, flags)}
    for name, n, k in SHAPES:
        qtype = gk.SUPPORTED_TYPES[name]
        raw = torch.from_numpy(random_blocks(name, n, k))
        packed = {tag: gk.pack(raw, qtype, k, lib) for tag, lib in libs.items()}
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            best = dict.fromkeys(libs, float("inf"))
            calls = 20 if m < 16 else 5
            for round_ in range(8):
                order = list(libs.items()) if round_ % 2 == 0 else list(libs.items())[::-1]
                for tag, lib in order:
                    start = time.perf_counter()
                    for _ in range(calls):
                        gk.matmul_packed(x, packed[tag], qtype, n, k, lib)
                    best[tag] = min(best[tag], (time.perf_counter() - start) / calls)
            ops = 2 * m * n * k / 1e9
            print(
                f"{args.variant} {name:6s} rows {m:4d} n {n:5d} k {k:5d}: base "
                f"{ops / best['base']:5.0f}, head {ops / best['head']:5.0f} Gops/s, "
                f"x{best['base'] / best['head']:.2f}",
                flush=True,
            )
    os.unlink(base)


if __name__ == "__main__":
    main()
