"""One stream on a mixture of experts: a GGUF with Qwen3-30B-A3B's layer shapes (hidden
2048, 32 / 4 heads of 128, 128 experts of 768, 8 a token; vocab 151,936) but fewer layers,
random Q4_0 blocks, and the tokenizer of a real Qwen GGUF (so llama.cpp loads it too).
Writes the file; then time it with benchmarks/alternate.sh gguf-latency PAIRS FILE.

    .venv/bin/python benchmarks/gguf_moe_shape.py --tokenizer-from QWEN.gguf --out /tmp/moe.gguf

With --shape gpt-oss: gpt-oss-20b's layers instead (hidden 2880, 64 / 8 heads of 64 with
sinks, a window of 128 on every other layer, 32 experts of 2880, 4 a token, with biases),
its experts in MXFP4 as released, the other matrices Q8_0; Qwen's vocabulary (gpt-oss's
has 201,088 tokens).
"""

from __future__ import annotations

import argparse

import numpy as np
from random_gguf import tensor_bytes, write_tensors

SHAPE = dict(
    hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8, expert_ff=768,
    dense_ff=6144, vocab=151936,
)  # fmt: skip
GPT_OSS_SHAPE = dict(
    hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, used=4, expert_ff=2880,
    dense_ff=2880, vocab=151936,
)  # fmt: skip


# Where each type's float16 scale sits in its block (the rest of the bytes are random; any
# grid indices and signs of the IQ types are valid too).
SCALE_AT = {"Q4_0": 0, "Q5_0": 0, "Q8_0": 0, "Q6_K": 208}
SCALE_AT.update({name: 0 for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S")})
SCALE_AT["MXFP4"] = -1  # an exponent byte at 0, set apart


def gpt_oss_tensors(layers: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """gpt-oss's layers: q/k/v/o with biases, sinks, a router with a bias, experts with
    biases (quantized: True for a matrix)."""
    s = GPT_OSS_SHAPE
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    e, f = s["experts"], s["expert_ff"]
    tensors = []
    for i in range(layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (h,), False),
            (f"blk.{i}.post_attention_norm.weight", (h,), False),
            (f"blk.{i}.attn_sinks.weight", (s["heads"],), False),
            (f"blk.{i}.attn_q.weight", (q, h), True),
            (f"blk.{i}.attn_q.bias", (q,), False),
            (f"blk.{i}.attn_k.weight", (kv, h), True),
            (f"blk.{i}.attn_k.bias", (kv,), False),
            (f"blk.{i}.attn_v.weight", (kv, h), True),
            (f"blk.{i}.attn_v.bias", (kv,), False),
            (f"blk.{i}.attn_output.weight", (h, q), True),
            (f"blk.{i}.attn_output.bias", (h,), False),
            (f"blk.{i}.ffn_gate_inp.weight", (e, h), False),
            (f"blk.{i}.ffn_gate_inp.bias", (e,), False),
            (f"blk.{i}.ffn_gate_exps.weight", (e, f, h), True),
            (f"blk.{i}.ffn_gate_exps.bias", (e, f), False),
            (f"blk.{i}.ffn_up_exps.weight", (e, f, h), True),
            (f"blk.{i}.ffn_up_exps.bias", (e, f), False),
            (f"blk.{i}.ffn_down_exps.weight", (e, h, f), True),
            (f"blk.{i}.ffn_down_exps.bias", (e, h), False),
        ]
    return tensors


def write(
    path: str,
    tokenizer_from: str,
    layers: int,
    seed: int = 0,
    expert_type: str = "Q4_0",
    shape: str = "qwen3moe",
) -> tuple[int, float]:
    """Write the file; returns its tensor bytes and the bytes one decoded token reads (every
    tensor but the embedding, and of the experts' only the 8 of 128 it is routed to). The
    experts' blocks are in ``expert_type``, the other matrices in Q4_0 (gpt-oss: MXFP4 and
    Q8_0)."""
    from gguf import GGUFReader, GGUFWriter

    gpt_oss = shape == "gpt-oss"
    s = GPT_OSS_SHAPE if gpt_oss else SHAPE
    other_type = "Q8_0" if gpt_oss else "Q4_0"
    if gpt_oss:
        expert_type = "MXFP4"
    vocab = s["vocab"]
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    tensors: list[tuple[str, tuple[int, ...], bool]] = [
        ("token_embd.weight", (vocab, h), True),
        ("output_norm.weight", (h,), False),
        ("output.weight", (vocab, h), True),
    ]
    if gpt_oss:
        tensors += gpt_oss_tensors(layers)
    for i in range(0 if gpt_oss else layers):
        e, f = s["experts"], s["expert_ff"]
        tensors += [
            (f"blk.{i}.attn_norm.weight", (h,), False),
            (f"blk.{i}.ffn_norm.weight", (h,), False),
            (f"blk.{i}.attn_q_norm.weight", (s["head_dim"],), False),
            (f"blk.{i}.attn_k_norm.weight", (s["head_dim"],), False),
            (f"blk.{i}.attn_q.weight", (q, h), True),
            (f"blk.{i}.attn_k.weight", (kv, h), True),
            (f"blk.{i}.attn_v.weight", (kv, h), True),
            (f"blk.{i}.attn_output.weight", (h, q), True),
            (f"blk.{i}.ffn_gate_inp.weight", (e, h), False),
            (f"blk.{i}.ffn_gate_exps.weight", (e, f, h), True),
            (f"blk.{i}.ffn_up_exps.weight", (e, f, h), True),
            (f"blk.{i}.ffn_down_exps.weight", (e, h, f), True),
        ]
    arch = "gpt-oss" if gpt_oss else "qwen3moe"
    writer = GGUFWriter(path, arch)
    for key, value in (
        ("context_length", 131072 if gpt_oss else 40960),
        ("embedding_length", h),
        ("block_count", layers),
        ("feed_forward_length", s["dense_ff"]),
        ("attention.head_count", s["heads"]),
        ("attention.head_count_kv", s["kv_heads"]),
        ("attention.key_length", s["head_dim"]),
        ("attention.value_length", s["head_dim"]),
        ("expert_count", s["experts"]),
        ("expert_used_count", s["used"]),
        ("expert_feed_forward_length", s["expert_ff"]),
    ):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 150_000.0 if gpt_oss else 1_000_000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if gpt_oss:
        writer.add_uint32(f"{arch}.attention.sliding_window", 128)
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", 32.0)
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", 4096)
    # the experts' blocks in expert_type, the other matrices in other_type
    tensors = [(n, d, (expert_type if "_exps" in n else other_type) if q else None)
               for n, d, q in tensors]  # fmt: skip
    per_token = sum(
        tensor_bytes(dims, kind) * (s["used"] / s["experts"] if "_exps" in name else 1)
        for name, dims, kind in tensors
        if name != "token_embd.weight"
    )
    reader = GGUFReader(tokenizer_from)
    total = write_tensors(
        writer, tensors, _float_data, tokenizer_reader=reader, fill_blocks=_fill_blocks, seed=seed
    )
    return total, per_token


def _float_data(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Varied routing, unit norms, small biases and sinks."""
    scale = 0.05 if "gate_inp" in name or name.endswith((".bias", "sinks.weight")) else 1.0
    return np.ones(dims, np.float32) if scale == 1.0 else rng.standard_normal(dims) * scale


def _fill_blocks(kind: str, blocks: np.ndarray, rng: np.random.Generator) -> None:
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    if kind == "MXFP4":  # exponents 2^-10 .. 2^-8 (the values are up to 12 times that)
        blocks[:, 0] = rng.integers(118, 121, size=blocks.shape[0], dtype=np.uint8)
        return
    block = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    scales = (rng.standard_normal(blocks.shape[0]) * 0.002 * 32 / block).astype(np.float16)
    at = SCALE_AT[kind]
    blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)  # small finite scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer-from", required=True, help="a Qwen2/3 GGUF file")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--expert-type", choices=sorted(SCALE_AT), default="Q4_0")
    parser.add_argument("--shape", choices=["qwen3moe", "gpt-oss"], default="qwen3moe")
    args = parser.parse_args()
    total, per_token = write(
        args.out, args.tokenizer_from, args.layers, expert_type=args.expert_type, shape=args.shape
    )
    print(f"wrote {args.out}: {total / 1e9:.2f} GB of tensors; a decoded token reads "
          f"{per_token / 1e6:.0f} MB of them")  # fmt: skip


if __name__ == "__main__":
    main()
