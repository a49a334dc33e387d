"""A random-weight Q4_0 GGUF of a Qwen2.5 shape (1.5B or 3B), for benchmarks that need steps
long enough that what the engine core does per step is a small part of one (issue 56's
pipeline on two cores). The tokenizer is copied from a real Qwen2 GGUF (the 0.5B's: the same
vocabulary); the weights are random Q4_0 blocks with small scales and unit norms, so every
activation stays finite and a step costs what the real model's would. The text it generates
means nothing.

    .venv/bin/python benchmarks/random_qwen2_gguf.py /tmp/qwen2-1.5b-random.gguf \\
        --tokenizer-from /work/models/qwen2.5-coder-0.5b-instruct.gguf --shape 1.5b
"""

from __future__ import annotations

import argparse

import numpy as np
from random_gguf import Q4, Tensor, write_tensors

# Qwen2.5's published dimensions (config.json of Qwen/Qwen2.5-1.5B and -3B).
SHAPES = {
    "1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, ff=8960),
    "3b": dict(hidden=2048, layers=36, heads=16, kv_heads=2, ff=11008),
}
HEAD_DIM = 128


def _tensors(s: dict, vocab: int) -> list[Tensor]:
    """(name, dims in PyTorch order, GGML type or None) of every tensor of the file."""
    h, f = s["hidden"], s["ff"]
    q, kv = s["heads"] * HEAD_DIM, s["kv_heads"] * HEAD_DIM
    tensors = [
        ("token_embd.weight", (vocab, h), Q4),
        ("output_norm.weight", (h,), None),
        ("output.weight", (vocab, h), Q4),
    ]
    for i in range(s["layers"]):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (h,), None),
            (f"blk.{i}.ffn_norm.weight", (h,), None),
            (f"blk.{i}.attn_q.weight", (q, h), Q4),
            (f"blk.{i}.attn_q.bias", (q,), None),
            (f"blk.{i}.attn_k.weight", (kv, h), Q4),
            (f"blk.{i}.attn_k.bias", (kv,), None),
            (f"blk.{i}.attn_v.weight", (kv, h), Q4),
            (f"blk.{i}.attn_v.bias", (kv,), None),
            (f"blk.{i}.attn_output.weight", (h, q), Q4),
            (f"blk.{i}.ffn_gate.weight", (f, h), Q4),
            (f"blk.{i}.ffn_up.weight", (f, h), Q4),
            (f"blk.{i}.ffn_down.weight", (h, f), Q4),
        ]
    return tensors


def write(path: str, tokenizer_from: str, shape: str = "1.5b", seed: int = 0) -> int:
    """Write the file; returns its tensor bytes."""
    from gguf import GGUFReader, GGUFWriter

    s = SHAPES[shape]
    reader = GGUFReader(tokenizer_from)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensors = _tensors(s, vocab)
    arch = "qwen2"
    writer = GGUFWriter(path, arch)
    for key, value in (
        ("context_length", 32768),
        ("embedding_length", s["hidden"]),
        ("block_count", s["layers"]),
        ("feed_forward_length", s["ff"]),
        ("attention.head_count", s["heads"]),
        ("attention.head_count_kv", s["kv_heads"]),
    ):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 1_000_000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    return write_tensors(writer, tensors, _float_data, tokenizer_reader=reader, seed=seed)


def _float_data(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    return np.zeros(dims) if name.endswith(".bias") else np.ones(dims)  # unit norms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--tokenizer-from", required=True, help="a Qwen2 GGUF (its tokenizer)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    args = parser.parse_args()
    total = write(args.path, args.tokenizer_from, args.shape)
    print(f"wrote {args.path}: {total / 2**30:.2f} GiB of tensors")


if __name__ == "__main__":
    main()
