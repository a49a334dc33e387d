"""HF transformers' batched `generate` on the standard throughput workload: the floor.

The same prompts as `minivllm bench throughput` (random token ids, seed 0), all of one
length so no padding is needed, sampled at temperature 1 with every token allowed, exactly
--output-len new tokens each; only the `generate` call is timed. Writes vLLM's JSON keys.

    .venv/bin/python benchmarks/hf_throughput.py --model DIR --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm.bench.datasets import random_token_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF directory (prepare_model.py)")
    # vLLM's flag names, so compare_vllm.py hands over the same workload arguments.
    parser.add_argument("--dataset-name", default="random", choices=["random"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument(
        "--random-input-len", "--input-len", dest="input_len", type=int, default=128
    )
    parser.add_argument(
        "--random-output-len", "--output-len", dest="output_len", type=int, default=128
    )
    parser.add_argument("--batch-size", type=int, default=256, help="prompts per generate")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    prompts = random_token_prompts(tokenizer, args.num_prompts, args.input_len, seed=0)
    sample = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    lengths = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len)
    output_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), args.batch_size):
            ids = torch.tensor(prompts[i : i + args.batch_size])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **sample, **lengths)
            output_tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    elapsed = time.perf_counter() - start
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(prompts),
        "output_tokens_per_second": output_tokens / elapsed,
    }
    print(f"Throughput: {result['output_tokens_per_second']:.2f} output tokens/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
