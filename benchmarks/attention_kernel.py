#!/usr/bin/env python
"""The CPU paged attention kernel alone (`paged_attention_f32`), this tree's against another
revision's source built in the same process, interleaved: Gflop/s (4 flops per query head,
attended position and head dimension), best of 5 rounds of 10 calls, 2 threads.

    python benchmarks/attention_kernel.py [--base REV]

Cases: prompts of 128 and 512 tokens in 8-row tiles and decode rows at 512 positions with
SmolLM2's heads (9 over 3, head size 64); prompts of 256 and decode rows at 1,024 positions
with 16 heads over 8 of size 128 (Qwen3's kind). Block size 16, a request's blocks in order.
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

from minivllm.kernels import cpu_kernels as ck  # noqa: E402

CASES = [  # (name, requests, tokens, heads, kv heads, head size, decode)
    ("prompts 16 x 128, 9/3 heads, D 64", 16, 128, 9, 3, 64, False),
    ("prompts 16 x 512, 9/3 heads, D 64", 16, 512, 9, 3, 64, False),
    ("decode 64 rows at 512, 9/3 heads, D 64", 64, 512, 9, 3, 64, True),
    ("prompts 16 x 256, 16/8 heads, D 128", 16, 256, 16, 8, 128, False),
    ("decode 64 rows at 1024, 16/8 heads, D 128", 64, 1024, 16, 8, 128, True),
]


def build(source: str):
    with kernel_source(ck, source, ck._load_library):
        return ck.load_library()


def case_call(lib, P, T, H, Hkv, D, decode):
    """A closure running the case once, and its flop count."""
    nblk = (T + 15) // 16
    k_cache, v_cache = torch.randn(P * nblk, Hkv, D, 16), torch.randn(P * nblk, 16, Hkv, D)
    table = torch.arange(P * nblk).view(P, nblk)
    if decode:
        q, seq_lens, tiles = torch.randn(P, H, D), torch.full((P,), T), None
    else:
        q = torch.randn(P * T, H, D)
        table = table.repeat_interleave(T, 0).contiguous()
        seq_lens = torch.arange(1, T + 1).repeat(P)
        tiles = torch.tensor([*range(0, P * T, 8), P * T])
    flops = 4 * H * D * float(seq_lens.sum())
    return (
        lambda: ck.paged_attention(lib, q, k_cache, v_cache, table, seq_lens, D**-0.5, tiles=tiles)
    ), flops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", help="git revision whose kernel source to run beside")
    args = parser.parse_args()
    torch.set_num_threads(2)
    libs = {"head": build(ck._SOURCE)}
    if args.base:
        libs = {"base": build(source_at(args.base, "minivllm/kernels/cpu_kernels.c")), **libs}
    for name, *shape in CASES:
        calls = {tag: case_call(lib, *shape) for tag, lib in libs.items()}
        best = dict.fromkeys(libs, float("inf"))
        for _ in range(5):
            for tag, (call, _) in calls.items():
                call()
                start = time.perf_counter()
                for _ in range(10):
                    call()
                best[tag] = min(best[tag], (time.perf_counter() - start) / 10)
        flops = calls["head"][1]
        rates = ", ".join(f"{tag} {flops / t / 1e9:.1f}" for tag, t in best.items())
        print(f"{name}: {rates} Gflop/s")


if __name__ == "__main__":
    main()
