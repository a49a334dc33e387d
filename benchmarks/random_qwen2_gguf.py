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

# Qwen2.5's published dimensions (config.json of Qwen/Qwen2.5-1.5B and -3B).
SHAPES = {
    "1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, ff=8960),
    "3b": dict(hidden=2048, layers=36, heads=16, kv_heads=2, ff=11008),
}
HEAD_DIM = 128
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # 32 values: an fp16 scale, then 16 bytes of nibbles


def _tensors(s: dict, vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, dims in PyTorch order, quantized) of every tensor of the file."""
    h, f = s["hidden"], s["ff"]
    q, kv = s["heads"] * HEAD_DIM, s["kv_heads"] * HEAD_DIM
    tensors = [
        ("token_embd.weight", (vocab, h), True),
        ("output_norm.weight", (h,), False),
        ("output.weight", (vocab, h), True),
    ]
    for i in range(s["layers"]):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (h,), False),
            (f"blk.{i}.ffn_norm.weight", (h,), False),
            (f"blk.{i}.attn_q.weight", (q, h), True),
            (f"blk.{i}.attn_q.bias", (q,), False),
            (f"blk.{i}.attn_k.weight", (kv, h), True),
            (f"blk.{i}.attn_k.bias", (kv,), False),
            (f"blk.{i}.attn_v.weight", (kv, h), True),
            (f"blk.{i}.attn_v.bias", (kv,), False),
            (f"blk.{i}.attn_output.weight", (h, q), True),
            (f"blk.{i}.ffn_gate.weight", (f, h), True),
            (f"blk.{i}.ffn_up.weight", (f, h), True),
            (f"blk.{i}.ffn_down.weight", (h, f), True),
        ]
    return tensors


def write(path: str, tokenizer_from: str, shape: str = "1.5b", seed: int = 0) -> int:
    """Write the file; returns its tensor bytes."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

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
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    total = 0
    for name, dims, quantized in tensors:
        count = int(np.prod(dims))
        if quantized:
            nbytes = count // Q4_0_BLOCK * Q4_0_BYTES
            byte_shape = (*dims[:-1], dims[-1] // Q4_0_BLOCK * Q4_0_BYTES)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=GGMLQuantizationType.Q4_0
            )
        else:
            nbytes = count * 4
            writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes)
        total += nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, quantized in tensors:
        if not quantized:
            data = np.zeros(dims) if name.endswith(".bias") else np.ones(dims)  # unit norms
            writer.write_tensor_data(np.asarray(data, dtype=np.float32))
            continue
        rows = int(np.prod(dims[:-1]))
        count = rows * dims[-1] // Q4_0_BLOCK
        blocks = rng.integers(0, 256, size=(count, Q4_0_BYTES), dtype=np.uint8)
        # Small finite fp16 scales: values of about 0.01, so the residual stream stays finite.
        scales = (rng.standard_normal(blocks.shape[0]) * 0.002).astype(np.float16)
        blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
        writer.write_tensor_data(blocks.reshape(*dims[:-1], -1))
    writer.close()
    return total


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
