"""`minivllm bench throughput`: offline throughput of one generate() call, as vLLM prints it."""

from __future__ import annotations

import argparse
import time

from minivllm.bench.common import add_engine_args, engine_kwargs, print_header, write_json
from minivllm.bench.datasets import random_token_prompts


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--dataset-name", default="random", choices=["random"])
    parser.add_argument("--input-len", "--random-input-len", type=int, default=128)
    parser.add_argument("--output-len", "--random-output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> dict:
    from minivllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    prompts = random_token_prompts(
        llm.get_tokenizer(), args.num_prompts, args.input_len, seed=args.seed
    )
    # vLLM's harness samples at temperature 1.0; the same workload on both engines.
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    # Warm-up outside the figure: first-call allocations and kernel selection.
    llm.generate(
        {"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=2), use_tqdm=False
    )
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    results = {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    results["device"] = print_header(
        "Throughput Benchmark Result", llm.llm_engine.vllm_config.device
    )
    print(
        f"Throughput: {results['requests_per_second']:.2f} requests/s, "
        f"{results['tokens_per_second']:.2f} total tokens/s, "
        f"{results['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    write_json(args.output_json, results)
    return results
