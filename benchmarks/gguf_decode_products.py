#!/usr/bin/env python
"""One decode step's GGUF products of a few activation rows on a model's shapes, this tree's
kernel against another revision's, alternating in one process: GB/s of weight bytes read.

    python benchmarks/gguf_decode_products.py --base REV [--model qwen35|lfm2|smollm2]
        [--type Q4_0] [--threads 1,2] [--rows 1,2,3,4]
    python benchmarks/gguf_decode_products.py --pages [--model ...]

--rows: the activation rows of each product (1: one stream decoding; 2-4: as many streams
at once, a request's n-gram verification rows).

--pages: this tree's kernel on both sides, the weights in 4 KiB pages (base) against
transparent huge pages (head, MINIVLLM_CPU_HUGE_PAGES).

MINIVLLM_CPU_ISA=avx2|generic builds both for that instruction-set path.

A recurrent layer's products (in_proj, out_proj, gate_up, down) are called in order on
copies of the weights that together pass the L3 cache (--megabytes; 8 keeps them in it, to
see the kernel's compute apart from memory), so the bytes come from memory as in a real
step, through the C entry point with its arguments kept ready, as the CPU graphs call it.
With --threads 1 the clock is the thread's CPU time (time other processes took the core
left out); with more, the wall clock. The machine may be shared: compare the base / head
ratios within one run (best of the rounds, and the median of each round's adjacent pair),
not absolute GB/s across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from revision_source import kernel_source, source_at  # noqa: E402

from minivllm.kernels import gguf_kernels as gk  # noqa: E402
from tests.kernels.test_gguf_kernels import random_blocks  # noqa: E402

# (n, k) of one layer's products: Qwen3.5-0.8B's DeltaNet layer (in_proj qkvz, out_proj)
# and MLP; LFM2-1.2B's short-convolution layer (in_proj, out_proj) and MLP; the bundled
# SmolLM2-135M's attention layer (qkv, o) and MLP (its file is Q4_1).
SHAPES = {
    "qwen35": [(8192, 1024), (1024, 2048), (7168, 1024), (1024, 3584)],
    "lfm2": [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
}


def build(source: str | None):
    with kernel_source(gk, source, gk._load_gguf_kernels):
        return gk.load_gguf_kernels()


def run(args, libs: dict, packed: dict, qtype: int, layer_bytes: int, m: int, threads: int):
    """Rounds of every layer copy's products of m rows, base and head alternating; prints
    the figures."""
    shapes = SHAPES[args.model]
    xs = [torch.randn(m, k) for _, k in shapes]
    ys = [torch.empty(m, n) for n, _ in shapes]
    # One thread: its CPU time, which leaves out the time other processes took the core
    # (a kernel's own cost, steadier on a shared machine); more: the wall clock.
    clock = time.thread_time if threads == 1 else time.perf_counter
    best = dict.fromkeys(libs, float("inf"))
    ratios = []  # base / head of each round's adjacent pair: steadier than the bests
    for round_ in range(args.rounds):
        order = list(libs.items()) if round_ % 2 == 0 else list(libs.items())[::-1]
        seconds = {}
        for tag, lib in order:
            call = lib.gguf_packed_matmul
            plans = [
                [
                    (qtype, w.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr(), n)
                    for w, (n, k), x, y in zip(layer, shapes, xs, ys)
                ]  # fmt: skip
                for layer in packed[tag]
            ]
            start = clock()
            for layer in plans:
                for a in layer:
                    call(*a)
            seconds[tag] = clock() - start
            best[tag] = min(best[tag], seconds[tag])
        ratios.append(seconds["base"] / seconds["head"])
    copies = len(packed["head"])
    total = copies * layer_bytes / 1e9
    calls = copies * len(shapes)
    print(
        f"{gk.packed_path(libs['head'])} {args.type} {args.model} rows {m} threads {threads}: "
        f"base {total / best['base']:5.1f}, head {total / best['head']:5.1f} GB/s "
        f"({best['base'] / calls * 1e6:.0f} / {best['head'] / calls * 1e6:.0f} us a call), "
        f"best x{best['base'] / best['head']:.3f}, "
        f"median pair x{statistics.median(ratios):.3f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", help="git revision of the kernel to compare")
    parser.add_argument(
        "--pages", action="store_true", help="4 KiB pages (base) against huge pages (head)"
    )
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen35")
    parser.add_argument("--type", default="Q4_0")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--rows", default="1", help="activation rows of each product")
    parser.add_argument("--megabytes", type=int, default=96, help="weight bytes to cycle over")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if (args.base is None) == (not args.pages):
        parser.error("give --base REV or --pages")
    base = source_at(args.base, "minivllm/kernels/gguf_kernels.c") if args.base else None
    libs = {"base": build(base) if base else build(None), "head": build(None)}
    huge = {"base": "0" if args.pages else "1", "head": "1"}  # MINIVLLM_CPU_HUGE_PAGES
    qtype = gk.SUPPORTED_TYPES[args.type]
    shapes = SHAPES[args.model]
    layer_bytes = sum(n * gk.row_bytes(qtype, k) for n, k in shapes)
    copies = max(1, args.megabytes * 2**20 // layer_bytes)
    raws = [torch.from_numpy(random_blocks(args.type, n, k, seed=i)) for i, (n, k) in
            enumerate(shapes)]  # fmt: skip
    packed = {}
    for tag, lib in libs.items():
        os.environ["MINIVLLM_CPU_HUGE_PAGES"] = huge[tag]  # read by each pack
        packed[tag] = [
            [gk.pack(raw, qtype, k, lib) for raw, (_, k) in zip(raws, shapes)]
            for _ in range(copies)
        ]  # fmt: skip
    for m in (int(r) for r in args.rows.split(",")):
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            run(args, libs, packed, qtype, layer_bytes, m, threads)
    if base:
        os.unlink(base)


if __name__ == "__main__":
    main()
