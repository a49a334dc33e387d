"""Hybrid models against llama.cpp on the same GGUF file (issue 50, acceptance 4): writes a
GGUF with Qwen3.5-0.8B's (qwen35) or LFM2-1.2B's (lfm2) layer shapes, random Q4_0 matrices
and the bundled SmolLM2 GGUF's tokenizer (49,152 tokens: Qwen3.5's 248k vocabulary would
only add to the output product), which both llama.cpp and minivllm load; then, with
--vs-llamacpp PAIRS, alternates llama.cpp's llama-bench and minivllm on that file and
thread count, PAIRS times each, and prints every run and the medians:

- one stream's decode rate after a 128-token and after a 4,096-token context (llama-bench
  -n 64 -d 128 / -d 4096; minivllm: 64 tokens after a prompt of that length);
- a 512-token prompt's rate (llama-bench -p 512; minivllm: 512 tokens over the time to the
  first token).

With --kv-cache-dtype int8 or int8k_int8v, llama-bench gets the cache of the same kind
(-ctv q8_0, and -ctk q8_0 for int8 keys): at 4k the cache's reads weigh on the decode rate.

    .venv/bin/python benchmarks/gguf_hybrid_shape.py --shape qwen35 --out /tmp/qwen35-q4.gguf
    .venv/bin/python benchmarks/gguf_hybrid_shape.py --shape lfm2 --out /tmp/lfm2-q4.gguf \\
        --vs-llamacpp 3 --threads 2

The bar: minivllm's decode and prompt rates >= 1.2x llama.cpp's, and minivllm's decode
rate at 4k within 10% of its rate at 128: each round's 4k decode against a 128-token decode
run right after it ("adjacent"; the host's memory speed can flip within seconds, and the
round's own 128-token decode ran ~25 s before, a llama-bench run of 4k tokens between).
Each run's line also gives the host's memory read rate just before each engine's run (a
512 MB sum, ~60 ms): both engines read the whole file every token, so when the memory is
slow both are bound by it and the decode ratio shrinks towards the ratio of bytes read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import numpy as np
from random_gguf import Q4, Tensor, write_tensors

# Qwen3.5-0.8B: hidden 1024, 24 layers (every 4th gated attention, 8 / 2 heads of 256,
# a quarter of each rotated), DeltaNet with 16 key and 16 value heads of 128, conv 4, MLP
# 3584, tied embeddings. LFM2-1.2B: hidden 2048, 16 layers (attention at 2, 5, 8, 10, 12,
# 14 with 32 / 8 heads of 64), short convolutions of 3 taps, MLP 8192, tied embeddings.
QWEN35 = dict(hidden=1024, layers=24, heads=8, kv_heads=2, head_dim=256, ff=3584,
              k_heads=16, v_heads=16, k_dim=128, v_dim=128, conv=4, interval=4)  # fmt: skip
LFM2 = dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ff=8192, conv=3,
            attention=(2, 5, 8, 10, 12, 14))  # fmt: skip
LLAMA_BENCH = os.environ.get("LLAMA_BENCH", "/work/llamacpp/build/bin/llama-bench")
# llama.cpp's cache of the same kind as minivllm's cache format (kv_cache_format's name: the
# `int8` alias is fp16k_int8v), so that the 4k decode is compared like with like: q8_0 is int8
# with a scale per 32 values; its default is float16.
LLAMACPP_CACHE = {
    "fp16k_int8v": ["-ctk", "f16", "-ctv", "q8_0"],
    "int8k_int8v": ["-ctk", "q8_0", "-ctv", "q8_0"],
}


def qwen35_tensors(vocab: int) -> tuple[list[Tensor], dict]:
    s, h = QWEN35, QWEN35["hidden"]
    key, value = s["k_heads"] * s["k_dim"], s["v_heads"] * s["v_dim"]
    t: list[Tensor] = [
        ("token_embd.weight", (vocab, h), Q4),
        ("output_norm.weight", (h,), None),
    ]
    for i in range(s["layers"]):
        b = f"blk.{i}"
        t += [(f"{b}.attn_norm.weight", (h,), None)]
        t += [(f"{b}.post_attention_norm.weight", (h,), None)]
        if (i + 1) % s["interval"] == 0:
            q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
            t += [
                (f"{b}.attn_q.weight", (2 * q, h), Q4),  # the queries and their gate
                (f"{b}.attn_k.weight", (kv, h), Q4),
                (f"{b}.attn_v.weight", (kv, h), Q4),
                (f"{b}.attn_output.weight", (h, q), Q4),
                (f"{b}.attn_q_norm.weight", (s["head_dim"],), None),
                (f"{b}.attn_k_norm.weight", (s["head_dim"],), None),
            ]
        else:
            t += [
                (f"{b}.attn_qkv.weight", (2 * key + value, h), Q4),
                (f"{b}.attn_gate.weight", (value, h), Q4),
                (f"{b}.ssm_conv1d.weight", (2 * key + value, s["conv"]), None),
                (f"{b}.ssm_dt.bias", (s["v_heads"],), None),
                (f"{b}.ssm_a", (s["v_heads"],), None),
                (f"{b}.ssm_beta.weight", (s["v_heads"], h), None),
                (f"{b}.ssm_alpha.weight", (s["v_heads"], h), None),
                (f"{b}.ssm_norm.weight", (s["v_dim"],), None),
                (f"{b}.ssm_out.weight", (h, value), Q4),
            ]
        t += [
            (f"{b}.ffn_gate.weight", (s["ff"], h), Q4),
            (f"{b}.ffn_up.weight", (s["ff"], h), Q4),
            (f"{b}.ffn_down.weight", (h, s["ff"]), Q4),
        ]
    keys = {
        "context_length": 32768, "embedding_length": h, "block_count": s["layers"],
        "feed_forward_length": s["ff"], "attention.head_count": s["heads"],
        "attention.head_count_kv": s["kv_heads"], "attention.key_length": s["head_dim"],
        "attention.value_length": s["head_dim"], "rope.dimension_count": s["head_dim"] // 4,
        "ssm.conv_kernel": s["conv"], "ssm.state_size": s["k_dim"],
        "ssm.group_count": s["k_heads"], "ssm.time_step_rank": s["v_heads"],
        "ssm.inner_size": value, "full_attention_interval": s["interval"],
    }  # fmt: skip
    return t, keys


def lfm2_tensors(vocab: int) -> tuple[list[Tensor], dict]:
    s, h = LFM2, LFM2["hidden"]
    t: list[Tensor] = [
        ("token_embd.weight", (vocab, h), Q4),
        ("token_embd_norm.weight", (h,), None),  # LFM2's final norm, under this name
    ]
    for i in range(s["layers"]):
        b = f"blk.{i}"
        t += [(f"{b}.attn_norm.weight", (h,), None), (f"{b}.ffn_norm.weight", (h,), None)]
        if i in s["attention"]:
            kv = s["kv_heads"] * s["head_dim"]
            t += [
                (f"{b}.attn_q.weight", (h, h), Q4),
                (f"{b}.attn_k.weight", (kv, h), Q4),
                (f"{b}.attn_v.weight", (kv, h), Q4),
                (f"{b}.attn_output.weight", (h, h), Q4),
                (f"{b}.attn_q_norm.weight", (s["head_dim"],), None),
                (f"{b}.attn_k_norm.weight", (s["head_dim"],), None),
            ]
        else:
            t += [
                (f"{b}.shortconv.in_proj.weight", (3 * h, h), Q4),
                (f"{b}.shortconv.conv.weight", (h, s["conv"]), None),
                (f"{b}.shortconv.out_proj.weight", (h, h), Q4),
            ]
        t += [
            (f"{b}.ffn_gate.weight", (s["ff"], h), Q4),
            (f"{b}.ffn_up.weight", (s["ff"], h), Q4),
            (f"{b}.ffn_down.weight", (h, s["ff"]), Q4),
        ]
    keys = {
        "context_length": 128000, "embedding_length": h, "block_count": s["layers"],
        "feed_forward_length": s["ff"], "attention.head_count": s["heads"],
        "shortconv.l_cache": s["conv"],
    }  # fmt: skip
    return t, keys


def write(path: str, shape: str, tokenizer_from: str, seed: int = 0) -> int:
    """Write the file; returns its tensor bytes."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(tokenizer_from)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensors, keys = (qwen35_tensors if shape == "qwen35" else lfm2_tensors)(vocab)
    writer = GGUFWriter(path, shape)
    writer.add_file_type(2)  # mostly Q4_0 (llama.cpp's label)
    for key, value in keys.items():
        writer.add_uint32(f"{shape}.{key}", value)
    writer.add_float32(f"{shape}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{shape}.rope.freq_base", 10_000_000.0 if shape == "qwen35" else 1e6)
    if shape == "qwen35":  # llama.cpp requires the (text-only: plain) MRoPE sections
        writer.add_array(f"{shape}.rope.dimension_sections", [11, 11, 10, 0])
    else:  # lfm2: KV heads per layer, 0 for the convolution layers
        kv = [LFM2["kv_heads"] if i in LFM2["attention"] else 0 for i in range(LFM2["layers"])]
        writer.add_array(f"{shape}.attention.head_count_kv", kv)
    return write_tensors(writer, tensors, _float_data, tokenizer_reader=reader, seed=seed)


def _float_data(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """An unquantized tensor's values: the state-space parameters small and random, norms 1."""
    if name.endswith(("ssm_a", "ssm_dt.bias", "conv1d.weight", "conv.weight")):
        if name.endswith("ssm_a"):
            return -np.abs(rng.standard_normal(dims))
        return rng.standard_normal(dims) * 0.1
    if "ssm_beta" in name or "ssm_alpha" in name:
        return rng.standard_normal(dims) * 0.02
    return np.ones(dims)  # norms (llama.cpp's qwen35 norms hold 1 + w)


def llamacpp(path: str, threads: int, args: list[str], cache: list[str] | None = None) -> float:
    """llama-bench's tokens per second for one test (-p N or -n N [-d D]), its cache's
    types `cache` (LLAMACPP_CACHE)."""
    cmd = [LLAMA_BENCH, "-m", path, "-t", str(threads), "-r", "1", "-o", "json", *(cache or [])]
    cmd += args
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def minivllm_rates(llm, context: int, decode: int) -> tuple[float, float]:
    """(prompt tokens/s, decode tokens/s) of one stream: a random prompt of context tokens
    (timed to its first token), then decode tokens (timed from the first token to the
    last, in the same request: the engine is stepped here)."""
    from minivllm import SamplingParams

    rng = np.random.default_rng(context)
    prompt = {"prompt_token_ids": rng.integers(100, 40000, size=context).tolist()}
    params = SamplingParams(max_tokens=decode, ignore_eos=True, temperature=0.0)
    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_request(f"bench-{context}-{start}", prompt, params)
    first = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    return context / (first - start), (decode - 1) / max(end - first, 1e-9)


def settle(llm) -> int:
    """After llama-bench: let the engine's thread count see the quiet machine again, and
    return it. By default it follows the cores other processes keep busy
    (MINIVLLM_CPU_THREADS_FOLLOW_LOAD), read every 2 s from the CPU time they used since the
    last reading; the first reading after a llama-bench run covers that run (both cores
    busy), which left minivllm's next ~2 s (a whole 64-token decode) on one thread. A tiny
    request takes that reading, a pause past the interval and another take a quiet one."""
    import torch

    minivllm_rates(llm, 16, 2)
    time.sleep(2.5)
    minivllm_rates(llm, 16, 2)
    return torch.get_num_threads()


def hybrid_engine(path: str, decode: int, kv_cache_dtype: str = "auto"):
    """The in-process engine the side-by-side times (hybrid_decode_split.py splits the same
    one's steps): a 4,096-token prompt and its decode fit one step; no prefix cache."""
    from minivllm import LLM

    return LLM(
        path,
        quantization="gguf",
        max_model_len=4096 + decode + 8,
        max_num_batched_tokens=4096 + decode + 8,
        enable_prefix_caching=False,
        enable_multiprocessing=False,
        kv_cache_dtype=kv_cache_dtype,
    )


def runner_of(llm):
    """The in-process engine's model runner (UniProcExecutor's worker)."""
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def host_read_rate(buf) -> float:
    """GB/s of reading ``buf`` (512 MB) with torch's threads, best of 3 (~60 ms): this
    minute's memory speed. The host's moves between ~35 and ~80 GB/s within minutes
    (BENCHMARKS.md, 2026-11-29), and with it both engines' one-stream rates, which read the
    whole file every token: a round's ratio is read beside it."""
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        buf.sum()
        best = max(best, buf.numel() * buf.element_size() / (time.perf_counter() - start) / 1e9)
    return best


def side_by_side(
    path: str, pairs: int, threads: int, decode: int = 64, kv_cache_dtype: str = "auto"
) -> None:
    import torch

    torch_threads(threads)  # before the engine starts; in-process, so its products use them
    llm = hybrid_engine(path, decode, kv_cache_dtype)
    probe = torch.ones(128 << 20)  # host_read_rate's 512 MB
    minivllm_rates(llm, 128, 4)  # warm-up
    from minivllm.attention.kv_quant import kv_cache_format

    cache = LLAMACPP_CACHE.get(kv_cache_format(kv_cache_dtype).name, [])
    print(f"minivllm --kv-cache-dtype {kv_cache_dtype}; llama.cpp {' '.join(cache) or 'f16'}")
    adjacent_128: list[float] = []

    def at_4096() -> float:
        rate = minivllm_rates(llm, 4096, decode)[1]
        adjacent_128.append(minivllm_rates(llm, 128, decode)[1])  # (the 4k ratio's pair)
        return rate

    tests = {
        "prompt 512": (["-p", "512", "-n", "0"], lambda: minivllm_rates(llm, 512, 2)[0]),
        "decode @128": (["-p", "0", "-n", str(decode), "-d", "128"],
                        lambda: minivllm_rates(llm, 128, decode)[1]),
        "decode @4096": (["-p", "0", "-n", str(decode), "-d", "4096"], at_4096),
    }  # fmt: skip
    results: dict[str, dict[str, list[float]]] = {
        k: {"llama.cpp": [], "minivllm": []} for k in tests
    }
    for round_ in range(pairs):
        for name, (bench_args, ours) in tests.items():
            memory = [host_read_rate(probe)]
            theirs = llamacpp(path, threads, bench_args, cache)
            used = settle(llm)
            memory.append(host_read_rate(probe))
            mine = ours()
            results[name]["llama.cpp"].append(theirs)
            results[name]["minivllm"].append(mine)
            after = f", then @128 {adjacent_128[-1]:.1f}" if ours is at_4096 else ""
            print(f"round {round_ + 1} {name}: llama.cpp {theirs:.1f} tok/s, "
                  f"minivllm {mine:.1f} tok/s{after} (threads: {used}; memory before each "
                  f"{memory[0]:.0f} / {memory[1]:.0f} GB/s)", flush=True)  # fmt: skip
    for name, runs in results.items():
        theirs, mine = statistics.median(runs["llama.cpp"]), statistics.median(runs["minivllm"])
        print(f"median {name}: llama.cpp {theirs:.1f}, minivllm {mine:.1f} tok/s "
              f"({mine / theirs:.2f}x)")  # fmt: skip
    ours = {k: statistics.median(v["minivllm"]) for k, v in results.items()}
    # The host's memory speed can change between rounds (a ratio of medians then mixes two
    # speeds) and within one: the 4k rate against the 128-token decode right after it.
    at_128, at_4096 = results["decode @128"]["minivllm"], results["decode @4096"]["minivllm"]
    for label, base in (("the round's @128", at_128), ("adjacent @128", adjacent_128)):
        rounds = [b / a for a, b in zip(base, at_4096, strict=True)]
        of_medians = ours["decode @4096"] / statistics.median(base)
        print(f"minivllm decode @4096 / {label}: {of_medians:.3f} "
              f"(per round {' '.join(f'{r:.2f}' for r in rounds)}; "
              f"median {statistics.median(rounds):.3f})")  # fmt: skip


def torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=["qwen35", "lfm2"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer-from", default=None, help="default: the bundled GGUF")
    parser.add_argument("--vs-llamacpp", type=int, default=0, metavar="PAIRS")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="minivllm's (auto: float32 on the CPU; llama.cpp's cache is float16): at 4k "
        "tokens the attention layers' cache reads weigh on the decode rate",
    )
    args = parser.parse_args()
    if not os.path.exists(args.out):
        from minivllm.model.loader import default_model_path

        total = write(args.out, args.shape, args.tokenizer_from or default_model_path())
        print(f"wrote {args.out}: {total / 1e9:.2f} GB of tensors")
    if args.vs_llamacpp:
        side_by_side(args.out, args.vs_llamacpp, args.threads, kv_cache_dtype=args.kv_cache_dtype)


if __name__ == "__main__":
    main()
