"""Offline throughput with every request using penalties + top-k + top-p + logprobs=5, against
plain greedy, on the standard workload (256 prompts x 128 random token ids in, 128 out,
ignore_eos, bundled model). Each run is a fresh process; the two modes alternate.

    .venv/bin/python benchmarks/sampling_overhead.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MODES = {
    "greedy": dict(temperature=0.0),
    "penalties+top-k+top-p+logprobs": dict(
        temperature=0.8,
        top_k=50,
        top_p=0.95,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logprobs=5,
    ),
}


def run_in_this_process(mode: str, num_prompts: int, input_len: int, output_len: int) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.bench.datasets import random_token_prompts

    llm = LLM(enable_prefix_caching=False)
    prompts = random_token_prompts(llm.get_tokenizer(), num_prompts, input_len, seed=0)
    params = SamplingParams(ignore_eos=True, max_tokens=output_len, seed=None, **MODES[mode])
    llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if MODES[mode].get("logprobs"):
        assert all(len(o.outputs[0].logprobs) == output_len for o in outputs)
    return {"elapsed_time": elapsed, "output_tokens_per_second": output_tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.num_prompts, args.input_len, args.output_len)
    if args.child:
        print(json.dumps(run_in_this_process(args.child, *shape)))
        return
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(args.runs):
        for mode in MODES:
            command = [sys.executable, __file__, "--child", mode]
            command += ["--num-prompts", str(shape[0]), "--input-len", str(shape[1])]
            command += ["--output-len", str(shape[2])]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results[mode].append(result["output_tokens_per_second"])
            print(
                f"run {i + 1} {mode:>32}: {result['elapsed_time']:6.1f} s  "
                f"{result['output_tokens_per_second']:6.1f} output tok/s",
                flush=True,
            )
    medians = {mode: statistics.median(values) for mode, values in results.items()}
    for mode, value in medians.items():
        print(f"median {mode:>32}: {value:.1f} output tok/s")
    greedy, heavy = medians.values()
    print(f"heavy sampling / greedy: {heavy / greedy:.3f}")


if __name__ == "__main__":
    main()
