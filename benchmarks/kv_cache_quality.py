"""Perplexity and greedy top-1 agreement with each --kv-cache-dtype against the float32 cache
(issue #53), on issue #15's fixed text (the installed packages' METADATA files; see
gguf_perplexity.py), in chunks of --chunk tokens (long chunks, so that attention reads a
long quantized context). Not a timing benchmark.

A 4-bit cache is measured by simulation only (``int4-sim``): K and V rounded to 4-bit levels
in groups of 32 values (llama.cpp q4_0's grouping, symmetric, scale amax / 7) over the float32
cache; it is not shipped unless it holds perplexity within 2%. Other groupings of an int8
cache are simulated the same way: ``int8-row-sim`` (one scale per token and KV head, what
``int8k_int8v`` stores, unrotated) and ``int8-g32-sim`` (one scale per 32 values, q8_0's
grouping). ``int8`` is ``fp16k_int8v``: float16 keys, int8 values.

Acceptance: int8/fp8 perplexity within 0.5% of float32's, top-1 agreement >= 98%.

    .venv/bin/python benchmarks/kv_cache_quality.py                    # 20,480 tokens
    .venv/bin/python benchmarks/kv_cache_quality.py --num-tokens 4096  # a quick check

``auto`` goes first in --dtypes: the others' agreement is counted against it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))
from gguf_perplexity import fixed_text  # noqa: E402

DTYPES = ["auto", "int8", "int8k_int8v", "fp8_e4m3", "fp8_e5m2", "int4-sim"]
# name: simulate()'s arguments (levels either side of zero, values per scale, 0: a head row,
# and what differs from its defaults), run over the float32 cache.
SIMULATED = {
    "int4-sim": dict(levels=7, group=32),
    "int8-row-sim": dict(levels=127, group=0),
    "int8-g32-sim": dict(levels=127, group=32),
    # Keys (and values) rotated by a fixed signed Hadamard matrix before the rounding.
    "int8-rot-sim": dict(levels=127, group=0, rotate="kv"),
    "int8-rotk-sim": dict(levels=127, group=0, rotate="k"),
    # float16 keys, int8 values (one scale per token and head): fp16k_int8v, simulated.
    "k16-v8-sim": dict(levels=127, group=0, float16_keys=True),
    # float16 keys, fp8 values: scale 1 (vLLM's), or one scale per token and head (amax over
    # the format's largest value).
    "k16-e4m3-sim": dict(levels=0, group=0, float16_keys=True, fp8_values="e4m3"),
    "k16-e4m3-row-sim": dict(
        levels=0, group=0, float16_keys=True, fp8_values="e4m3", fp8_row_scale=True
    ),
    "k16-e5m2-row-sim": dict(
        levels=0, group=0, float16_keys=True, fp8_values="e5m2", fp8_row_scale=True
    ),
    # int8 keys with one scale per channel over each 16 tokens written (KIVI's per-channel
    # keys, the grouping of a cache block; an outlier channel gets its own scale), int8
    # values with one per token and head: a cache of 2 D + 4 + D / 8 bytes (float16 scales)
    # a token and head against fp16k_int8v's 3 D + 4, were it built.
    "k8ch16-v8-sim": dict(levels=127, group=0, key_channel_tokens=16),
    # The same with the queries rounded to int8 too, as an integer key pass would take them:
    # one scale a query row (token and head), or one per 32 values (llama.cpp's q8_0 blocks,
    # its q8_0 x q8_0 dot products).
    "k8ch16-q8-v8-sim": dict(levels=127, group=0, key_channel_tokens=16, query_group=0),
    "k8ch16-q8g32-v8-sim": dict(levels=127, group=0, key_channel_tokens=16, query_group=32),
    # int8 keys with one scale per token and head (int8k_int8v's rows, unrotated) after each
    # channel is divided by a fixed factor per layer, KV head and channel (the query
    # multiplied by it: the scores are unchanged), measured once on a calibration prompt
    # before the scored ones: how far the channel's largest |k| there is above the head's
    # median channel's (1 below it), as a power of two. Calibrated on seeded random token
    # ids (what an engine could run at start-up with no text) or on text the scoring does
    # not read. int8 values per row.
    "k8smooth-rand-v8-sim": dict(levels=127, group=0, smooth="rand"),
    "k8smooth-text-v8-sim": dict(levels=127, group=0, smooth="text"),
    # With the queries in int8 too, one scale per 32 values (an integer key pass's input).
    "k8smooth-rand-q8g32-v8-sim": dict(levels=127, group=0, query_group=32, smooth="rand"),
    # The same keys with values in 4 bits, one scale per 32 or 16 values (q4_0's grouping,
    # symmetric): a cache of D + 4 + D / 2 + D / 16 bytes a token and head at 32 (404 at
    # head_dim 256, against int8k_int8v's 520).
    "k8smooth-rand-v4g32-sim": dict(levels=127, group=0, smooth="rand", values=(7, 32)),
    "k8smooth-rand-v4g16-sim": dict(levels=127, group=0, smooth="rand", values=(7, 16)),
}
# Calibration prompts of the k8smooth simulations (set in main), and their per-layer
# statistics: the largest |k| of each (KV head, channel), by the layer's cache tensor.
CALIBRATION: dict[str, list[int]] = {}
_key_amax: dict[int, object] = {}
_collecting = [False]
_forward = None


def rotation_matrix(head_dim: int):
    """diag(signs) @ H / sqrt(head_dim), a normalized Sylvester Hadamard matrix with fixed
    random signs on its rows (what int8k_int8v stored its keys in before 2026-11-29; the
    rotated simulations' basis). head_dim a power of two."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(53)
    signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
    return signs[:, None] * h / head_dim**0.5


def simulate(
    levels: int,
    group: int,
    rotate: str = "",
    float16_keys: bool = False,
    fp8_values: str = "",
    fp8_row_scale: bool = False,
    key_channel_tokens: int = 0,
    query_group: int | None = None,
    smooth: str = "",
    values: tuple[int, int] | None = None,
) -> None:
    """Round every K and V the CPU backend writes to `levels` symmetric integer levels per
    `group` values (0: per head row), from now on in this process; `rotate` names the
    tensors ("k", "kv") rounded in a rotated basis (the rotation undone after);
    `fp8_values` ("e4m3", "e5m2") rounds values to that float8 instead, scaled per head row
    to the format's largest value with `fp8_row_scale`; `key_channel_tokens` rounds keys
    with a scale per channel over each that many consecutive tokens written (a write's rows
    are a prompt's positions in order when it is a whole chunk, as here); `query_group`
    rounds the queries to int8 levels as well, one scale per that many values (0: a row);
    `smooth` ("rand", "text") divides each key channel by its calibrated factor before the
    rounding (and multiplies it back after); `values` (levels, group) rounds the values of a
    smoothed simulation differently from its keys."""
    import torch

    from minivllm.attention.cpu import CPUAttentionBackend
    from minivllm.attention.kv_smoothing import key_factors

    global _forward
    _forward = _forward or CPUAttentionBackend.forward
    forward = _forward

    def rounded(x: torch.Tensor, group: int = group) -> torch.Tensor:
        return rounded_to(x, levels, group)

    def rounded_to(x: torch.Tensor, levels: int, group: int) -> torch.Tensor:
        shape = x.shape
        g = x.float().reshape(*shape[:-1], -1, group or shape[-1])
        scale = g.abs().amax(-1, keepdim=True) / levels
        q = torch.round(g / torch.where(scale > 0, scale, torch.ones_like(scale)))
        return (q.clamp(-levels - 1, levels) * scale).reshape(shape).to(x.dtype)

    fp8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(fp8_values)

    def float8(x: torch.Tensor) -> torch.Tensor:
        top = torch.finfo(fp8).max
        scale = torch.ones_like(x[..., :1].float())
        if fp8_row_scale:
            amax = x.float().abs().amax(-1, keepdim=True)
            scale = torch.where(amax > 0, amax / top, scale)
        q = (x.float() / scale).clamp(-top, top).to(fp8)
        return (q.float() * scale).to(x.dtype)

    def per_channel(x: torch.Tensor) -> torch.Tensor:
        """`rounded` along the tokens: each channel's values over each g rows (the last
        group padded with zeros) share a scale."""
        t, g = x.shape[0], key_channel_tokens
        padded = torch.zeros((-(-t // g) * g, *x.shape[1:]), dtype=torch.float32)
        padded[:t] = x.float()
        blocks = padded.reshape(-1, g, *x.shape[1:]).movedim(1, -1)  # [T / g, ..., g]
        return rounded(blocks, 0).movedim(-1, 1).reshape(padded.shape)[:t].to(x.dtype)

    def smoothed(x: torch.Tensor, layer: int) -> torch.Tensor:
        """Rows of x [T, Hkv, D] rounded after dividing each channel by its factor."""
        if _collecting[0]:
            amax = x.float().abs().amax(0)
            seen = _key_amax.get(layer)
            _key_amax[layer] = amax if seen is None else torch.maximum(seen, amax)
            return x
        factor = key_factors(_key_amax[layer])  # the engine's rule
        return (rounded(x.float() / factor) * factor).to(x.dtype)

    def maybe_rotated(x: torch.Tensor, name: str) -> torch.Tensor:
        if name == "k" and key_channel_tokens:
            return per_channel(x)
        if name == "v" and fp8 is not None:
            return float8(x)
        if name == "k" and float16_keys:
            return x.to(torch.float16).to(x.dtype)
        if name not in rotate:
            return rounded(x)
        r = rotation_matrix(x.shape[-1])
        return (rounded(x.float() @ r) @ r.T).to(x.dtype)

    def simulated_forward(self, q, k, v, kv_cache, *args, **kwargs):
        if query_group is not None:
            q = rounded(q, query_group)
        if smooth:
            if not _collecting[0]:
                v = rounded(v) if values is None else rounded_to(v, *values)
            k = smoothed(k, kv_cache.data_ptr())
        else:
            k, v = maybe_rotated(k, "k"), maybe_rotated(v, "v")
        return forward(self, q, k, v, kv_cache, *args, **kwargs)

    CPUAttentionBackend.forward = simulated_forward


def score(
    kv_cache_dtype: str, chunks: list[list[int]], model: str | None, quantization: str | None
) -> dict:
    from minivllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        kv_cache_dtype="auto" if kv_cache_dtype in SIMULATED else kv_cache_dtype,
        enable_multiprocessing=False,
        enable_prefix_caching=False,
        max_model_len=max(len(c) for c in chunks) + 8,
        quantization=quantization,
    )
    smooth = SIMULATED.get(kv_cache_dtype, {}).get("smooth")
    if smooth:
        _key_amax.clear()
        _collecting[0] = True
        llm.generate({"prompt_token_ids": CALIBRATION[smooth]}, SamplingParams(max_tokens=1))
        _collecting[0] = False
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": c} for c in chunks]
    nll, count, top1 = 0.0, 0, []
    for chunk, out in zip(chunks, llm.generate(prompts, params), strict=True):
        for token, position in zip(chunk[1:], out.prompt_logprobs[1:], strict=True):
            nll -= position[token].logprob
            count += 1
            top1.append(next(t for t, lp in position.items() if lp.rank == 1))
    del llm
    return {"perplexity": math.exp(nll / count), "tokens": count, "top1": top1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--num-tokens", type=int, default=20480)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--quantization",
        default=None,
        help="`none` reads a GGUF dequantized to float32: no int8 activations in the "
        "matrix products, whose rounding flips near-tied top-1 tokens whatever the cache",
    )
    args = parser.parse_args()

    from minivllm.model.loader import resolve_model_path
    from minivllm.platforms.cpu import cpu_model_name
    from minivllm.tokenizer import load_tokenizer

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode(fixed_text())
    if len(ids) < args.num_tokens:
        sys.exit(f"the fixed text has only {len(ids)} tokens")
    # Calibration prompts for k8smooth: seeded random ids, or the text after the scored part.
    rng = random.Random(0)
    CALIBRATION["rand"] = [rng.randrange(tokenizer.vocab_size) for _ in range(512)]
    CALIBRATION["text"] = ids[args.num_tokens : args.num_tokens + 512] or ids[-512:]
    ids = ids[: args.num_tokens]
    chunks = [ids[i : i + args.chunk] for i in range(0, len(ids), args.chunk)]
    chunks = [c for c in chunks if len(c) > 1]
    dtypes = args.dtypes.split(",")
    table = {"model": path, "cpu": cpu_model_name(), "chunk": args.chunk}
    base = None
    # A simulation patches the backend for the rest of the process: they go last. Each
    # dtype's row is printed (and the JSON written) as it is done: a long run on a shared
    # machine keeps what it measured if it is stopped.
    for name in sorted(dtypes, key=lambda d: d in SIMULATED):
        if name in SIMULATED:
            simulate(**SIMULATED[name])
        r = score(name, chunks, path, args.quantization)
        base = r if name == "auto" else base
        row = {"perplexity": r["perplexity"], "tokens_scored": r["tokens"]}
        if base is not None:
            row["perplexity_ratio"] = r["perplexity"] / base["perplexity"]
            same = sum(a == b for a, b in zip(base["top1"], r["top1"], strict=True))
            row["top1_agreement"] = same / len(base["top1"])
        table[name] = row
        print(json.dumps({name: row}), flush=True)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(table, f, indent=2)
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
