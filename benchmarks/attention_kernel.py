#!/usr/bin/env python
"""The CPU paged attention kernel alone (`paged_attention_f32`), this tree's against another
revision's source built in the same process, interleaved: Gflop/s (4 flops per query head,
attended position and head dimension), best of 5 rounds of 10 calls, 2 threads (--threads).

    python benchmarks/attention_kernel.py [--base REV] [--threads N] [--only TEXT]
                                          [--pages huge|small|both]
                                          [--reads memory|resident|both]

Cases: prompts of 128 and 512 tokens in 8-row tiles and decode rows at 512 positions with
SmolLM2's heads (9 over 3, head size 64); prompts of 256 and decode rows at 1,024 positions
with 16 heads over 8 of size 128 (Qwen3's kind); one stream's decode row at 128 and 4,096
positions with Qwen3.5-0.8B's full-attention heads (8 over 2, head size 256), over a float32
cache, an int8k_int8v one and the fp16k_int8v one that --kv-cache-dtype int8 names, and over
the last two with LFM2-1.2B's heads too (32 over 8 of 64). Issue 50: its 4k decode step is one
row per layer; these cases also give the cache bytes read a second, GB/s, against the
machine's memory bandwidth; their calls go round copies of the cache, 64 MB in all, so that
it is read from memory as in a model. Block size 16, a request's blocks in order. The caches lie
in transparent huge pages, as the engine's since 6b2d93f (--pages small: ordinary 4 KiB
pages; both: each library over both kinds, interleaved). --reads resident: every call reads
the same copy, from L3 where it fits (a 4k decode's 4.3 MB does), so the time is the kernel's
work with memory out of it; both: each library both ways, interleaved (BENCHMARKS.md, "Issue
50's 4k call: near its compute floor as well").
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

from minivllm.attention.cpu import kv_views  # noqa: E402
from minivllm.attention.kv_quant import kv_cache_format  # noqa: E402
from minivllm.kernels import cpu_kernels as ck  # noqa: E402
from minivllm.platforms import get_platform  # noqa: E402

CPU = get_platform("cpu")  # its zeros(): the engine's KV cache memory, in huge pages or not

CASES = [  # (name, requests, tokens, heads, kv heads, head size, decode, cache)
    ("prompts 16 x 128, 9/3 heads, D 64", 16, 128, 9, 3, 64, False, "auto"),
    ("prompts 16 x 512, 9/3 heads, D 64", 16, 512, 9, 3, 64, False, "auto"),
    ("decode 64 rows at 512, 9/3 heads, D 64", 64, 512, 9, 3, 64, True, "auto"),
    ("prompts 16 x 256, 16/8 heads, D 128", 16, 256, 16, 8, 128, False, "auto"),
    ("decode 64 rows at 1024, 16/8 heads, D 128", 64, 1024, 16, 8, 128, True, "auto"),
    ("decode 1 row at 128, 8/2 heads, D 256", 1, 128, 8, 2, 256, True, "auto"),
    ("decode 1 row at 4096, 8/2 heads, D 256", 1, 4096, 8, 2, 256, True, "auto"),
    ("decode 1 row at 128, 8/2 heads, D 256, int8", 1, 128, 8, 2, 256, True, "int8k_int8v"),
    ("decode 1 row at 4096, 8/2 heads, D 256, int8", 1, 4096, 8, 2, 256, True, "int8k_int8v"),
    ("decode 1 row at 128, 8/2 heads, D 256, fp16k_int8v", 1, 128, 8, 2, 256, True, "int8"),
    ("decode 1 row at 4096, 8/2 heads, D 256, fp16k_int8v", 1, 4096, 8, 2, 256, True, "int8"),
    ("decode 1 row at 128, 32/8 heads, D 64, fp16k_int8v", 1, 128, 32, 8, 64, True, "int8"),
    ("decode 1 row at 4096, 32/8 heads, D 64, fp16k_int8v", 1, 4096, 32, 8, 64, True, "int8"),
    ("decode 1 row at 128, 32/8 heads, D 64, int8", 1, 128, 32, 8, 64, True, "int8k_int8v"),
    ("decode 1 row at 4096, 32/8 heads, D 64, int8", 1, 4096, 32, 8, 64, True, "int8k_int8v"),
    ("prompts 4 x 256, 8/2 heads, D 256, int8", 4, 256, 8, 2, 256, False, "int8k_int8v"),
]


def random_cache(blocks: int, Hkv: int, D: int, name: str, huge: bool = True):
    """(keys, values, kv_type, bytes a position) of a cache of random rows, in the kernel's
    views (kv_views); an int8 cache's rows end in a valid float32 scale."""
    fmt = kv_cache_format(name)
    width = fmt.row_width(D)
    if not fmt.quantized:
        cache = CPU.zeros((2, blocks, 16, Hkv, width), torch.float32, huge_pages=huge)
        cache.copy_(torch.randn(cache.shape))
    else:  # (block-major: a block's keys and values side by side, as new_kv_cache's)
        shape = (blocks, 2, 16, Hkv, width) if fmt.block_major else (2, blocks, 16, Hkv, width)
        cache = CPU.zeros(shape, torch.uint8, huge_pages=huge)
        cache.copy_(torch.randint(0, 256, shape, dtype=torch.uint8))
        cache = cache.transpose(0, 1) if fmt.block_major else cache
    k_cache, v_cache = kv_views(cache, fmt)
    if fmt.fp16_keys:  # float16 keys: finite values, not random bits
        k_cache.copy_(torch.randn(k_cache.shape))
        v_cache[..., D:] = torch.full((blocks, 16, Hkv, 1), 0.02).view(torch.uint8)
    elif fmt.scale_bytes:  # a key block's head ends in its 16 keys' scales, a value row in its
        k_cache[:, :, D:] = (
            torch.full((blocks, Hkv, 16), 0.02).view(torch.uint8).view(blocks, Hkv, 4, 16)
        )
        v_cache[..., D:] = torch.full((blocks, 16, Hkv, 1), 0.02).view(torch.uint8)
    return k_cache, v_cache, fmt.code, 2 * Hkv * width * cache.element_size()


def build(source: str):
    with kernel_source(ck, source, ck._load_library):
        return ck.load_library()


def case_calls(libs: dict, pages: list[str], reads: list[str], P, T, H, Hkv, D, decode, cache):
    """For each library and kind of pages a closure running the case once, the flop count
    and the cache bytes it reads (each row's keys and values once). The libraries read one set
    of cache copies for each kind of pages:
    with a set each, two builds of the same source differed by up to ~6% and a variant's
    sign flipped between processes (where each set lands in memory; BENCHMARKS.md, "Qwen3.5's
    4k ratio: what bounds it")."""
    nblk = (T + 15) // 16
    # One stream's decode reads a layer's cache from memory (the model's other layers and
    # weights pass between), not from L3: its calls go round copies of 64 MB or more.
    layer_bytes = random_cache(1, Hkv, D, cache, False)[3] * 16 * P * nblk
    copies = -(-(64 << 20) // layer_bytes) if decode and P == 1 else 1
    sets = {
        kind: [random_cache(P * nblk, Hkv, D, cache, kind == "huge") for _ in range(copies)]
        for kind in pages
    }
    kv_type, position_bytes = sets[pages[0]][0][2:]
    table = torch.arange(P * nblk).view(P, nblk)
    if decode:
        q, seq_lens, tiles = torch.randn(P, H, D), torch.full((P,), T), None
    else:
        q = torch.randn(P * T, H, D)
        table = table.repeat_interleave(T, 0).contiguous()
        seq_lens = torch.arange(1, T + 1).repeat(P)
        tiles = torch.tensor([*range(0, P * T, 8), P * T])
    flops = 4 * H * D * float(seq_lens.sum())
    read = position_bytes * P * T

    # One turn for every library over a set: each call reads the copy after the last call's,
    # whichever library made it. With a turn each, the libraries went round the copies in
    # step, so the second read the copies the first had just read (from L3 at 128 positions:
    # x0.7 its time, and about x0.85 at 4k, for the same source built twice).
    turns = {kind: iter(range(1 << 62)) for kind in pages}

    def call_of(lib, kind, reading):
        def call():
            turn = 0 if reading == "resident" else next(turns[kind])
            k_cache, v_cache = sets[kind][turn % copies][:2]
            ck.paged_attention(
                lib, q, k_cache, v_cache, table, seq_lens, D**-0.5, tiles=tiles, kv_type=kv_type
            )

        return call

    def label(tag, kind, reading):
        return (
            tag
            + (f" ({kind} pages)" if len(pages) > 1 else "")
            + (f" ({reading})" if len(reads) > 1 else "")
        )

    calls = {
        label(tag, kind, reading): call_of(lib, kind, reading)
        for tag, lib in libs.items()
        for kind in pages
        for reading in reads
    }
    return calls, flops, read


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", help="git revision whose kernel source to run beside")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", help="run only the cases whose name holds this text")
    parser.add_argument(
        "--pages",
        choices=["huge", "small", "both"],
        default="huge",
        help="the caches' pages: transparent huge pages (the engine's), 4 KiB, or both",
    )
    parser.add_argument(
        "--reads",
        choices=["memory", "resident", "both"],
        default="memory",
        help="each call a copy of the cache not read since 64 MB ago, or always the same one",
    )
    args = parser.parse_args()
    pages = ["small", "huge"] if args.pages == "both" else [args.pages]
    reads = ["memory", "resident"] if args.reads == "both" else [args.reads]
    torch.set_num_threads(args.threads)
    libs = {"head": build(ck._SOURCE)}
    if args.base:
        libs = {"base": build(source_at(args.base, "minivllm/kernels/cpu_kernels.c")), **libs}
    for name, *shape in CASES:
        if args.only and args.only not in name:
            continue
        calls, flops, read = case_calls(libs, pages, reads, *shape)
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(5):
            for tag, call in calls.items():
                call()
                start = time.perf_counter()
                for _ in range(10):
                    call()
                best[tag] = min(best[tag], (time.perf_counter() - start) / 10)
        rates = ", ".join(
            f"{tag} {flops / t / 1e9:.1f} Gflop/s ({t * 1e6:.0f} us, {read / t / 1e9:.1f} GB/s)"
            for tag, t in best.items()
        )
        print(f"{name}: {rates}")


if __name__ == "__main__":
    main()
