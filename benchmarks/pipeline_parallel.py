"""Issue 56, acceptance 3: the batch queue keeps a two-stage pipeline busy. Under a
saturating load (many requests at once), each stage's idle time should be under 20% of the
run, and the throughput at least 1.6x the same pipeline's with one batch in flight
(MINIVLLM_PP_BATCH_QUEUE=0, where each stage waits while the other works).

    .venv/bin/python benchmarks/pipeline_parallel.py                       # bundled model
    .venv/bin/python benchmarks/pipeline_parallel.py --model /path/llama --num-prompts 64

Each configuration is built fresh, warmed with a few requests, then timed on
--num-prompts requests of --input-len random prompt tokens and --output-len generated
tokens (ignore_eos). Per stage it prints the share of the timed run the stage spent
neither computing nor waiting for a send to leave (its idle time: the run less its steps,
plus the part of its steps spent waiting for the stage before). The engine core runs in
this process; each stage is a worker process with its share of the cores
(MINIVLLM_CPU_OMP_THREADS_BIND=auto splits them). Say the machine's cores with the
figures: a 2-stage pipeline needs at least 2 free cores, and each stage's steps must be
long against the hand-off (a few ms of gloo per step on the CPU).
"""

from __future__ import annotations

import argparse
import os
import random
import time


def run(args: argparse.Namespace, batch_queue: bool) -> dict:
    os.environ["MINIVLLM_PP_BATCH_QUEUE"] = "1" if batch_queue else "0"
    from minivllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        pipeline_parallel_size=args.pp,
        tensor_parallel_size=args.tp,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.max_num_seqs,
        enable_multiprocessing=False,
        seed=0,
    )
    try:
        tokenizer = llm.get_tokenizer()
        rng = random.Random(0)
        vocab = len(tokenizer)
        prompts = [
            {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}
            for _ in range(args.num_prompts)
        ]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
        executor = llm.llm_engine.engine_core.engine_core.executor
        before = executor.collective_rpc("get_stage_times")
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = executor.collective_rpc("get_stage_times")
    finally:
        llm.llm_engine.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    idle = []
    for (step0, wait0), (step1, wait1) in zip(before, after):
        busy = (step1 - step0) - (wait1 - wait0)
        idle.append(max(0.0, 1 - busy / wall))
    return {"wall": wall, "tokens": tokens, "idle": idle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()
    print(f"cores available: {len(os.sched_getaffinity(0))}; pp={args.pp} tp={args.tp}")
    results = {}
    for batch_queue in (False, True):
        r = results[batch_queue] = run(args, batch_queue)
        label = f"{args.pp} batches in flight" if batch_queue else "1 batch in flight"
        idle = ", ".join(f"stage {i} idle {x:.0%}" for i, x in enumerate(r["idle"]))
        rate = r["tokens"] / r["wall"]
        print(f"{label}: {r['tokens']} tokens in {r['wall']:.2f} s = {rate:.1f} tok/s; {idle}")
    one, queued = results[False], results[True]
    ratio = (queued["tokens"] / queued["wall"]) / (one["tokens"] / one["wall"])
    print(f"throughput with the batch queue / one batch in flight: {ratio:.2f}x (target >= 1.6)")
    worst = max(queued["idle"])
    print(f"most idle stage with the batch queue: {worst:.0%} (target < 20%)")


if __name__ == "__main__":
    main()
