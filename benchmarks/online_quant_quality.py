"""Perplexity and greedy top-1 agreement of online quantization (``--quantization q8_0``,
``q4_0``, ...: a float checkpoint quantized at load to GGUF blocks, int8 kernels) against
the same checkpoint in float32 (``none``), on issue #15's fixed text (the installed
packages' METADATA files; see gguf_perplexity.py), in chunks of --chunk tokens.
Not a timing benchmark.

The default model is the bundled SmolLM2's float32 HF directory (prepare_model.py writes it
once). Acceptance (issue 49): q8_0 within 0.3% of float32's perplexity, 4-bit within 1%
(q4_1 here: this directory's weights are the bundled Q4_1 file's, on a grid q4_0 misses).

    .venv/bin/python benchmarks/online_quant_quality.py                    # 20,480 tokens
    .venv/bin/python benchmarks/online_quant_quality.py --num-tokens 4096  # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from gguf_perplexity import fixed_text, score  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a float HF directory (default: prepared)")
    parser.add_argument("--modes", default="q8_0,q4_1,q4_0")
    parser.add_argument("--num-tokens", type=int, default=20480)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    from prepare_model import prepare

    from minivllm.tokenizer import load_tokenizer

    path = args.model or prepare()
    ids = load_tokenizer(path).encode(fixed_text())
    if len(ids) < args.num_tokens:
        sys.exit(f"the fixed text has only {len(ids)} tokens")
    ids = ids[: args.num_tokens]
    chunks = [ids[i : i + args.chunk] for i in range(0, len(ids), args.chunk)]
    chunks = [c for c in chunks if len(c) > 1]
    dense = score("none", chunks, path)
    result: dict = {"model": path, "tokens_scored": dense["tokens"]}
    result["perplexity_float32"] = dense["perplexity"]
    for mode in args.modes.split(","):
        quant = score(mode, chunks, path)
        agree = sum(a == b for a, b in zip(dense["top1"], quant["top1"], strict=True))
        result[f"perplexity_{mode}"] = quant["perplexity"]
        result[f"perplexity_ratio_{mode}"] = quant["perplexity"] / dense["perplexity"]
        result[f"top1_agreement_{mode}"] = agree / len(dense["top1"])
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
