"""Scale check for quantization="gguf" (issue #15, acceptance 5): write a GGUF with
Llama-3.2-3B's shapes (hidden 3072, 28 layers, 24 / 8 heads, intermediate 8192, vocab
128,256, tied head) and random Q4_0 or Q4_K blocks, load it, and report the peak RSS (less
the KV cache) and one stream's decode rate (128 in / 128 out) beside the bandwidth bound
(the file's tensor bytes / --bandwidth-gbs). Prompts are token ids; the bundled model's
tokenizer stands in. The engine runs in this process; decode rates need a quiet machine
(on busy cores every kernel call waits for its second OpenMP thread to be scheduled).

    .venv/bin/python benchmarks/gguf_scale.py --out /tmp/llama3b-q4_0.gguf
    .venv/bin/python benchmarks/gguf_scale.py --out /tmp/tiny.gguf --tiny   # a quick check
Then serve it (the tokenizer: the bundled model's .gguf, default_model_path()):
    minivllm serve /tmp/llama3b-q4_0.gguf --tokenizer <bundled .gguf> --quantization gguf \
        --max-model-len 1024 --kv-cache-memory-bytes 268435456
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import numpy as np
from random_gguf import BlockFiller, Tensor, write_tensors

SHAPE_3B = dict(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, vocab=128256)
SHAPE_TINY = dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=49152)


def write_gguf(path: str, qtype_name: str, shape: dict, seed: int = 0) -> int:
    """Write the file; returns its tensor bytes."""
    from gguf import GGUFWriter

    h, head_dim = shape["hidden"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    tensors: list[Tensor] = [
        ("token_embd.weight", (shape["vocab"], h), qtype_name),
        ("output_norm.weight", (h,), None),
    ]
    for i in range(shape["layers"]):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (h,), None),
            (f"blk.{i}.ffn_norm.weight", (h,), None),
            (f"blk.{i}.attn_q.weight", (h, h), qtype_name),
            (f"blk.{i}.attn_k.weight", (kv, h), qtype_name),
            (f"blk.{i}.attn_v.weight", (kv, h), qtype_name),
            (f"blk.{i}.attn_output.weight", (h, h), qtype_name),
            (f"blk.{i}.ffn_gate.weight", (shape["intermediate"], h), qtype_name),
            (f"blk.{i}.ffn_up.weight", (shape["intermediate"], h), qtype_name),
            (f"blk.{i}.ffn_down.weight", (h, shape["intermediate"]), qtype_name),
        ]
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(h)
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(shape["vocab"])
    return write_tensors(writer, tensors, _ones, fill_blocks=scale_filler(qtype_name), seed=seed)


def _ones(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    return np.ones(dims)


def scale_filler(qtype_name: str) -> BlockFiller:
    """Small finite scales keep activations bounded: Q4_0's d at bytes 0-1, Q4_K's d and dmin
    at 0-1 and 2-3 (one draw each)."""
    scale_at = {"Q4_0": [0], "Q4_K": [0, 2]}[qtype_name]

    def fill(kind: str, blocks: np.ndarray, rng: np.random.Generator) -> None:
        for at in scale_at:
            scale = (rng.standard_normal(blocks.shape[0]) * 0.002).astype(np.float16)
            blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)

    return fill


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="where to write the .gguf")
    parser.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q4_K"])
    parser.add_argument("--tiny", action="store_true", help="a small model, to check the script")
    parser.add_argument("--quantization", default="gguf", choices=["gguf", "none"])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--bandwidth-gbs", type=float, default=22.0)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    args = parser.parse_args()

    shape = SHAPE_TINY if args.tiny else SHAPE_3B
    if not os.path.exists(args.out):
        write_gguf(args.out, args.type, shape)
    import torch

    from minivllm import LLM, SamplingParams
    from minivllm.model.loader import default_model_path, read_gguf_header

    header = read_gguf_header(args.out)
    file_tensor_bytes = os.path.getsize(args.out) - min(o for _, o in header.tensor_data.values())
    start = time.perf_counter()
    llm = LLM(
        model=args.out,
        tokenizer=default_model_path(),
        quantization=args.quantization,
        enable_multiprocessing=False,
        max_model_len=args.input_len + args.output_len + 16,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
    )
    load_s = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB
    rss = {field: _status_bytes(field) for field in ("VmRSS", "RssAnon", "RssFile")}
    prompt = {"prompt_token_ids": list(range(1000, 1000 + args.input_len))}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine = llm.llm_engine
    engine.add_request("one", prompt, params)
    first = end = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.outputs[0].token_ids for o in outs):
            first = time.perf_counter()
    end = time.perf_counter()
    decode_tps = (args.output_len - 1) / (end - first)
    bound_tps = args.bandwidth_gbs * 1e9 / file_tensor_bytes
    result = {
        "quantization": engine.quantization,
        "file_tensor_bytes": file_tensor_bytes,
        "weight_memory_bytes": engine.weight_memory_bytes,
        "load_s": load_s,
        "kv_cache_gb": args.kv_cache_memory_bytes / 1e9,
        "peak_rss_of_LLM_gb": peak_rss / 1e9,
        "peak_rss_less_kv_cache_gb": (peak_rss - args.kv_cache_memory_bytes) / 1e9,
        "rss_after_LLM_gb": {k: v / 1e9 for k, v in rss.items()},
        "input_len": args.input_len,
        "output_len": args.output_len,
        "threads": torch.get_num_threads(),
        "decode_tokens_per_s": decode_tps,
        "bandwidth_bound_tokens_per_s": bound_tps,
        "fraction_of_bound": decode_tps / bound_tps,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
