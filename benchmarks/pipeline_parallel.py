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

The batch queue splits the running requests over its batches, so each stage runs two steps
of half the rows where one batch in flight ran one of all of them. Per stage it also prints
the busy time per generated token in both runs: their ratio r bounds what the batch queue
can gain at 2 / r (a step that costs the same at half the rows, because it reads all of
its weights or runs the same Python whatever the rows, gains nothing). --random-gguf 1.5b
(or 3b) runs a random-weight Q4_0 GGUF of Qwen2.5-1.5B's (3B's) shape, written once in the
temporary directory (benchmarks/random_qwen2_gguf.py; the tokenizer from --model, a Qwen2
GGUF), whose steps are long against the engine core's part and the hand-off. --queue-max-num-seqs 64
(with --max-num-seqs 32 and 64 prompts) gives each of the batch queue's batches the rows of
one batch in flight, as vLLM V0's virtual engines had max_num_seqs each: that shows what the
pipeline gains where the concurrency is there, apart from the cost of halving each step.
The queue holds one batch a stage (vLLM's); --extra-batches 0 1 times that and then one batch
more (MINIVLLM_PP_EXTRA_BATCHES=1), each against the same one-batch run.
--max-num-batched-tokens sets every run's step budget: with the default 2048 a prompt chunk
is a step many times a decode step's, and the stage that holds the other batch's short step
waits out the long one.

    .venv/bin/python benchmarks/pipeline_parallel.py --random-gguf 1.5b \
        --model /work/models/qwen2.5-coder-0.5b-instruct.gguf --num-prompts 32
"""

from __future__ import annotations

import argparse
import os
import random
import time


def run(args: argparse.Namespace, batch_queue: bool, extra_batches: int = 0) -> dict:
    os.environ["MINIVLLM_PP_BATCH_QUEUE"] = "1" if batch_queue else "0"
    os.environ["MINIVLLM_PP_EXTRA_BATCHES"] = str(extra_batches)
    from minivllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        pipeline_parallel_size=args.pp,
        tensor_parallel_size=args.tp,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.queue_max_num_seqs if batch_queue else args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
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
        core = llm.llm_engine.engine_core.engine_core
        executor = core.executor
        in_flight = core.batch_queue.size if core.batch_queue is not None else 1
        before = executor.collective_rpc("get_stage_times")
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = executor.collective_rpc("get_stage_times")
    finally:
        llm.llm_engine.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    idle, busy, steps = [], [], []
    for (step0, wait0, n0), (step1, wait1, n1) in zip(before, after):
        busy.append((step1 - step0) - (wait1 - wait0))
        idle.append(max(0.0, 1 - busy[-1] / wall))
        steps.append(n1 - n0)
    return {
        "wall": wall,
        "tokens": tokens,
        "idle": idle,
        "busy": busy,
        "steps": steps,
        "in_flight": in_flight,
    }


def random_gguf(args: argparse.Namespace) -> str:
    """The random-weight GGUF of --random-gguf's shape, written once (it is kept: ~1 GiB
    for 1.5b, ~1.8 GiB for 3b)."""
    import tempfile

    import random_qwen2_gguf

    name = f"minivllm-random-qwen2-{args.random_gguf}-q4_0.gguf"
    path = os.path.join(tempfile.gettempdir(), name)
    if not os.path.exists(path):
        partial = path + ".partial"
        total = random_qwen2_gguf.write(partial, args.model, args.random_gguf)
        os.replace(partial, path)
        print(f"wrote {path}: {total / 2**30:.2f} GiB of random Q4_0 weights")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--random-gguf",
        choices=("1.5b", "3b"),
        default=None,
        help="run a random-weight Q4_0 GGUF of this Qwen2.5 shape (tokenizer: --model's)",
    )
    parser.add_argument(
        "--queue-max-num-seqs",
        type=int,
        default=None,
        help="max_num_seqs of the batch-queue run (default --max-num-seqs); pp x it gives "
        "each of its batches as many rows as one batch in flight has",
    )
    parser.add_argument(
        "--extra-batches",
        type=int,
        nargs="+",
        default=[0],
        help="MINIVLLM_PP_EXTRA_BATCHES of the batch-queue runs, one run each (`0 1`: "
        "vLLM's one batch a stage, then one more, in the same minute)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the step's token budget in every run (default the engine's, 2048): a prompt "
        "chunk of 2048 tokens is a step ~15x a decode step's on the 1.5B shape, and while one "
        "batch's chunk is on a stage the other stage finishes the other batch's short step "
        "and waits; smaller chunks keep the two batches' steps even",
    )
    args = parser.parse_args()
    if args.queue_max_num_seqs is None:
        args.queue_max_num_seqs = args.max_num_seqs
    if args.random_gguf:
        if args.model is None:
            parser.error("--random-gguf takes its tokenizer from --model (a Qwen2 GGUF)")
        args.model = random_gguf(args)
    print(f"cores available: {len(os.sched_getaffinity(0))}; pp={args.pp} tp={args.tp}")
    one = run(args, batch_queue=False)
    report("1 batch in flight", one)
    for extra in args.extra_batches:
        queued = run(args, batch_queue=True, extra_batches=extra)
        print()
        report(f"the batch queue, {queued['in_flight']} batches in flight", queued)
        for i, (busy_one, busy_queued) in enumerate(zip(one["busy"], queued["busy"])):
            r = (busy_queued / queued["tokens"]) / (busy_one / one["tokens"])
            print(
                f"stage {i}: busy time per token with the batch queue / one batch: {r:.2f}"
                f" (the batch queue can gain at most {args.pp / r:.2f}x)"
            )
        ratio = (queued["tokens"] / queued["wall"]) / (one["tokens"] / one["wall"])
        print(f"throughput with the batch queue / one batch in flight: {ratio:.2f}x (bar >= 1.6)")
        worst = max(queued["idle"])
        print(f"most idle stage with the batch queue: {worst:.0%} (target < 20%)")


def report(label: str, r: dict) -> None:
    idle = ", ".join(f"stage {i} idle {x:.0%}" for i, x in enumerate(r["idle"]))
    rate = r["tokens"] / r["wall"]
    print(f"{label}: {r['tokens']} tokens in {r['wall']:.2f} s = {rate:.1f} tok/s; {idle}")
    for i, (busy, steps) in enumerate(zip(r["busy"], r["steps"])):
        per_step = 1000 * busy / max(steps, 1)
        print(f"  stage {i}: {steps} steps, busy {per_step:.1f} ms a step")


if __name__ == "__main__":
    main()
