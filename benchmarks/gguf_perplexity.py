"""Perplexity and greedy top-1 agreement of quantization="gguf" (int8 activations) against
the float32-dequantized model (quantization="none"), on a fixed text (issue #15).

The text is the METADATA files (package descriptions) of the installed distributions, in
sorted order, tokenized and cut to --num-tokens; it is scored in chunks of --chunk tokens,
each a separate prompt (the first token of a chunk has no prediction). Acceptance:
perplexity within 1% and top-1 agreement >= 97%.

    .venv/bin/python benchmarks/gguf_perplexity.py                 # the bundled model
    .venv/bin/python benchmarks/gguf_perplexity.py --num-tokens 2048  # a quick check
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import site
import sys


def fixed_text() -> str:
    paths = []
    for root in site.getsitepackages():
        paths += glob.glob(os.path.join(root, "*.dist-info", "METADATA"))
    parts = []
    for path in sorted(paths, key=os.path.basename):
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return "\n\n".join(parts)


def score(quantization: str, chunks: list[list[int]], model: str | None) -> dict:
    from minivllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        quantization=quantization,
        enable_multiprocessing=False,
        enable_prefix_caching=False,
        max_model_len=max(len(c) for c in chunks) + 8,
    )
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": c} for c in chunks]
    nll, count, top1 = 0.0, 0, []
    for chunk, out in zip(chunks, llm.generate(prompts, params), strict=True):
        for token, position in zip(chunk[1:], out.prompt_logprobs[1:], strict=True):
            nll -= position[token].logprob
            count += 1
            top1.append(next(t for t, lp in position.items() if lp.rank == 1))
    return {"perplexity": math.exp(nll / count), "tokens": count, "top1": top1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-tokens", type=int, default=20480)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    from minivllm.model.loader import resolve_model_path
    from minivllm.tokenizer import load_tokenizer

    path = resolve_model_path(args.model)
    ids = load_tokenizer(path).encode(fixed_text())
    if len(ids) < args.num_tokens:
        sys.exit(f"the fixed text has only {len(ids)} tokens")
    ids = ids[: args.num_tokens]
    chunks = [ids[i : i + args.chunk] for i in range(0, len(ids), args.chunk)]
    chunks = [c for c in chunks if len(c) > 1]
    dense = score("none", chunks, path)
    quant = score("gguf", chunks, path)
    agree = sum(a == b for a, b in zip(dense["top1"], quant["top1"], strict=True))
    result = {
        "tokens_scored": dense["tokens"],
        "perplexity_float32": dense["perplexity"],
        "perplexity_gguf_int8": quant["perplexity"],
        "perplexity_ratio": quant["perplexity"] / dense["perplexity"],
        "top1_agreement": agree / len(dense["top1"]),
    }
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
