"""One stream on Gemma 4 E2B's kind of network: a gemma4 GGUF with random blocks and the
tokenizer of a real Gemma 3 GGUF (the same 262,144-token vocabulary), so llama.cpp loads it
too. Writes the file; then time it with benchmarks/alternate.sh gguf-latency PAIRS FILE.

    .venv/bin/python benchmarks/gguf_gemma4_shape.py --tokenizer-from GEMMA3.gguf \\
        --out /tmp/gemma4-e2b-shape.gguf

With --shape 26b-a4b: the mixture of experts' kind instead, with --layers of its 30 (default
8): hidden 2816, 16 query heads of 256 with 8 KV heads (global layers: 2 KV heads of 512,
their values the keys), a window of 1024 on five layers of six, a dense MLP of 2112 beside
128 experts of 704, 8 a token, each expert's weight scaled; experts' gate/up Q4_K, down
Q5_0 (704 columns are no whole K-quant blocks), the rest Q4_K, the head Q6_K. Its widths
are assumed too.

The shape is E2B's as far as this repository knows it (llama.cpp names a 35-layer gemma4
E2B; the widths below are assumed, not read from a released config): 35 layers, hidden
1536, 8 query heads and 1 KV head of 256 (global layers: 512, a quarter turned), a window of
512 on four layers of five, the last 20 layers reading earlier layers' K/V with MLPs twice
as wide (6144, 12288), per-layer embeddings of 256. Matrices Q4_K, the two embedding
tables Q6_K (a Q4_K_M file's kind); the head is the token embedding.
"""

from __future__ import annotations

import argparse

import numpy as np
from random_gguf import tensor_bytes, write_tensors

SHAPE = dict(
    layers=35, shared=20, hidden=1536, ff=6144, heads=8, kv_heads=1, head_dim=256,
    global_head_dim=512, per_layer=256, vocab=262144, window=512, pattern=5,
)  # fmt: skip


MOE_SHAPE = dict(
    layers=8, shared=0, hidden=2816, ff=2112, heads=16, kv_heads=8, global_kv_heads=2,
    head_dim=256, global_head_dim=512, per_layer=0, vocab=262144, window=1024, pattern=6,
    experts=128, used=8, expert_ff=704,
)  # fmt: skip


def moe_tensors(s: dict) -> list[tuple[str, tuple[int, ...], str | None]]:
    """26B-A4B's kind: attention (global layers without attn_v), a dense MLP and experts."""
    h, e, f = s["hidden"], s["experts"], s["expert_ff"]
    out: list[tuple[str, tuple[int, ...], str | None]] = [
        ("token_embd.weight", (s["vocab"], h), "Q6_K"),
        ("output_norm.weight", (h,), None),
        ("rope_freqs.weight", (s["global_head_dim"] // 2,), None),
    ]
    for i in range(s["layers"]):
        full = (i + 1) % s["pattern"] == 0
        d = s["global_head_dim"] if full else s["head_dim"]
        kv = s["global_kv_heads"] if full else s["kv_heads"]
        b = f"blk.{i}"
        out += [
            (f"{b}.attn_norm.weight", (h,), None),
            (f"{b}.attn_q.weight", (s["heads"] * d, h), "Q4_K"),
            (f"{b}.attn_k.weight", (kv * d, h), "Q4_K"),
            (f"{b}.attn_q_norm.weight", (d,), None),
            (f"{b}.attn_k_norm.weight", (d,), None),
            (f"{b}.attn_output.weight", (h, s["heads"] * d), "Q4_K"),
            (f"{b}.post_attention_norm.weight", (h,), None),
            (f"{b}.ffn_norm.weight", (h,), None),
            (f"{b}.ffn_gate.weight", (s["ff"], h), "Q4_K"),
            (f"{b}.ffn_up.weight", (s["ff"], h), "Q4_K"),
            (f"{b}.ffn_down.weight", (h, s["ff"]), "Q8_0"),  # 2112 columns: no K-quant
            (f"{b}.post_ffw_norm_1.weight", (h,), None),
            (f"{b}.ffn_gate_inp.weight", (e, h), None),
            (f"{b}.ffn_gate_inp.scale", (h,), None),
            (f"{b}.pre_ffw_norm_2.weight", (h,), None),
            (f"{b}.ffn_gate_up_exps.weight", (e, 2 * f, h), "Q4_K"),
            (f"{b}.ffn_down_exps.weight", (e, h, f), "Q5_0"),
            (f"{b}.ffn_down_exps.scale", (e,), None),
            (f"{b}.post_ffw_norm_2.weight", (h,), None),
            (f"{b}.post_ffw_norm.weight", (h,), None),
            (f"{b}.layer_output_scale.weight", (1,), None),
        ]
        if not full:
            out.append((f"{b}.attn_v.weight", (kv * d, h), "Q4_K"))
    return out


def tensors(s: dict) -> list[tuple[str, tuple[int, ...], str | None]]:
    """(name, shape, GGML type or None for float32), as llama.cpp's converter names them."""
    h, layers, p = s["hidden"], s["layers"], s["per_layer"]
    out: list[tuple[str, tuple[int, ...], str | None]] = [
        ("token_embd.weight", (s["vocab"], h), "Q6_K"),
        ("per_layer_token_embd.weight", (s["vocab"], layers * p), "Q6_K"),
        ("per_layer_model_proj.weight", (layers * p, h), "Q4_K"),
        ("per_layer_proj_norm.weight", (p,), None),
        ("output_norm.weight", (h,), None),
        ("rope_freqs.weight", (s["global_head_dim"] // 2,), None),
    ]
    for i in range(layers):
        full = (i + 1) % s["pattern"] == 0
        d = s["global_head_dim"] if full else s["head_dim"]
        sharing = i >= layers - s["shared"]
        ff = s["ff"] * (2 if sharing else 1)
        b = f"blk.{i}"
        out += [
            (f"{b}.attn_norm.weight", (h,), None),
            (f"{b}.attn_q.weight", (s["heads"] * d, h), "Q4_K"),
            (f"{b}.attn_q_norm.weight", (d,), None),
            (f"{b}.attn_output.weight", (h, s["heads"] * d), "Q4_K"),
            (f"{b}.post_attention_norm.weight", (h,), None),
            (f"{b}.ffn_norm.weight", (h,), None),
            (f"{b}.ffn_gate.weight", (ff, h), "Q4_K"),
            (f"{b}.ffn_up.weight", (ff, h), "Q4_K"),
            (f"{b}.ffn_down.weight", (h, ff), "Q4_K"),
            (f"{b}.post_ffw_norm.weight", (h,), None),
            (f"{b}.inp_gate.weight", (p, h), "Q4_K"),
            (f"{b}.proj.weight", (h, p), "Q4_K"),
            (f"{b}.post_norm.weight", (h,), None),
            (f"{b}.layer_output_scale.weight", (1,), None),
        ]
        if not sharing:
            out += [
                (f"{b}.attn_k.weight", (s["kv_heads"] * d, h), "Q4_K"),
                (f"{b}.attn_v.weight", (s["kv_heads"] * d, h), "Q4_K"),
                (f"{b}.attn_k_norm.weight", (d,), None),
            ]
    return out


def write(
    path: str, tokenizer_from: str, seed: int = 0, shape: str = "e2b", layers: int = 8
) -> tuple[int, float]:
    """Write the file; returns its tensor bytes and the bytes one decoded token reads (all
    but the per-layer table, of which it reads one row, and of the experts only the ones
    it is routed to)."""
    from gguf import GGUFReader, GGUFWriter

    moe = shape == "26b-a4b"
    s = dict(MOE_SHAPE, layers=layers) if moe else SHAPE
    layers = s["layers"]
    arch = "gemma4"
    writer = GGUFWriter(path, arch)
    writer.add_context_length(32768)
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(
        [s["ff"] * (2 if i >= layers - s["shared"] else 1) for i in range(layers)]
    )
    writer.add_head_count(s["heads"])
    if moe:
        writer.add_head_count_kv(
            [s["global_kv_heads"] if (i + 1) % s["pattern"] == 0 else s["kv_heads"]
             for i in range(layers)]
        )  # fmt: skip
        writer.add_expert_count(s["experts"])
        writer.add_expert_used_count(s["used"])
        writer.add_expert_feed_forward_length(s["expert_ff"])
    else:
        writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["global_head_dim"])
    writer.add_value_length(s["global_head_dim"])
    writer.add_key_length_swa(s["head_dim"])
    writer.add_value_length_swa(s["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(s["window"])
    writer.add_sliding_window_pattern([(i + 1) % s["pattern"] != 0 for i in range(layers)])
    writer.add_shared_kv_layers(s["shared"])
    writer.add_embedding_length_per_layer_input(s["per_layer"])
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_rope_freq_base_swa(10_000.0)
    writer.add_rope_dimension_count(s["global_head_dim"])
    writer.add_rope_dimension_count_swa(s["head_dim"])
    writer.add_final_logit_softcapping(30.0)
    table = moe_tensors(s) if moe else tensors(s)
    per_token = 0.0
    for name, dims, kind in table:
        nbytes = tensor_bytes(dims, kind)
        if name == "per_layer_token_embd.weight":
            per_token += nbytes / s["vocab"]
        elif "_exps.weight" in name:
            per_token += nbytes * s["used"] / s["experts"]
        else:  # the token embedding is the head too
            per_token += nbytes

    def float_data(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        if name == "rope_freqs.weight":  # a quarter of the global heads' pairs turn
            turned = s["global_head_dim"] // 8
            return np.array([1.0] * turned + [1e30] * (dims[0] - turned))
        if name.endswith("ffn_gate_inp.weight"):  # varied routing
            return rng.standard_normal(dims) * 0.05
        return np.ones(dims)

    total = write_tensors(
        writer,
        table,
        float_data,
        tokenizer_reader=GGUFReader(tokenizer_from),
        fill_blocks=_fill_blocks,
        seed=seed,
    )
    return total, per_token


def _fill_blocks(kind: str, blocks: np.ndarray, rng: np.random.Generator) -> None:
    """Small finite scales: Q4_K's d and dmin at bytes 0-3, Q6_K's d at 208-209, the d of
    Q5_0 and Q8_0 at 0-1."""
    scales = (rng.standard_normal((blocks.shape[0], 2)) * 0.002).astype(np.float16)
    at = 208 if kind == "Q6_K" else 0
    width = 4 if kind == "Q4_K" else 2
    blocks[:, at : at + width] = scales.view(np.uint8)[:, :width]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer-from", required=True, help="a Gemma 3 GGUF file")
    parser.add_argument("--shape", choices=["e2b", "26b-a4b"], default="e2b")
    parser.add_argument("--layers", type=int, default=8, help="26b-a4b: how many of its 30")
    args = parser.parse_args()
    total, per_token = write(args.out, args.tokenizer_from, shape=args.shape, layers=args.layers)
    print(f"wrote {args.out}: {total / 1e9:.2f} GB of tensors; a decoded token reads "
          f"{per_token / 1e6:.0f} MB of them")  # fmt: skip


if __name__ == "__main__":
    main()
