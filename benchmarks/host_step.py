"""The host's time a decode step, by phase, at 64 and 256 rows: what bounds the standard
workload on a GPU (issue 55), measured on a CPU with a model whose forward costs ~nothing.

The model is the Qwen3-0.6B family's tiny variant (2 layers, hidden 64, vocabulary 2,048)
with random weights (load_format="dummy", only its config and tokenizer written), the
engine core in this process. R prompts of 128 random ids each generate 128 tokens
(ignore_eos, temperature 1 as the standard workload's), all R running at once; only the
steps where every request decodes one token are counted. Each phase's time is taken with
perf_counter around the function that is that phase:

    schedule          Scheduler.schedule
    update_states     ModelRunner._update_states (the scheduler's diffs into the InputBatch)
    prepare           InputBatch.prepare (the step's inputs)
    attn_metadata     the attention backend's metadata (the CPU backend's; the GPU's
                      Triton backend takes the common metadata as it is)
    forward           ModelRunner._forward (the model: ~nothing here)
    logits            the LM head (compute_logits)
    sample            the sampling metadata and the sampler
    runner_output     ModelRunner._output (the requests take their tokens, the output)
    runner_other      the rest of ModelRunner.execute_model
    update_from_out   Scheduler.update_from_output (append, stop checks, outputs)
    process_outputs   OutputProcessor.process_outputs (detokenize included)
      detokenize      IncrementalDetokenizer.update (inside process_outputs)
    step_other        the rest of LLMEngine.step
    step              LLMEngine.step, all of it
    gc                Python's cyclic garbage collections during the step (inside the
                      phases above: the objects a step creates per request set them off)

It prints each phase's median microseconds a step, per request a step, and its share of
the step; then "host": the sum of the medians of the phases a GPU step keeps on its host
(all but forward, logits, sample and attn_metadata; the sampler's launches aside). A sum of
medians, not a median of sums: on a shared machine a step now and then loses a time slice
(~4 ms) to another process, in whichever phase it falls.

    PYTHONPATH=TREE .venv/bin/python benchmarks/host_step.py [--rows 64 256] [--repeat 3]
        [--output-kind final|delta|cumulative] [--temperature 1] [--profile]

The start-up heap is frozen (gc.freeze), as the engine core's own process does.
--output-kind: LLM.generate's (final: a request's output only when it ends) or a server's
stream (delta: every step). --profile: cProfile's top functions over the 256-row run too.
--json FILE: the medians by rows and phase. Compare two trees by running each in turn
(benchmarks/host_step_ab.sh alternates them), since the machine's speed varies.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import random
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_checkpoints  # noqa: E402

PHASES = (
    "schedule",
    "update_states",
    "prepare",
    "attn_metadata",
    "forward",
    "logits",
    "sample",
    "runner_output",
    "runner_other",
    "update_from_out",
    "process_outputs",
    "detokenize",
    "step_other",
    "step",
    "gc",
)
HOST_PHASES = (
    "schedule",
    "update_states",
    "prepare",
    "runner_output",
    "runner_other",
    "update_from_out",
    "process_outputs",
    "step_other",
)


class PhaseClock:
    """Seconds per phase within the current LLMEngine.step, kept for the steady steps."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.rows = 0  # the current step's scheduled requests
        self.tokens = 0
        self.steps: list[dict[str, float]] = []
        self.want_rows = 0
        self._gc_start = 0.0

    def wrap(self, owner, name: str, phase: str) -> None:
        """Time owner.name (an instance's method, or a class's function) as phase."""
        inner = getattr(owner, name)
        current = self.current

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                current[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def on_gc(self, phase: str, info: dict) -> None:
        """gc.callbacks: the time of each collection, in the step's "gc"."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.current["gc"] += time.perf_counter() - self._gc_start

    def begin(self) -> None:
        self.current.clear()
        self.rows = self.tokens = 0

    def end(self) -> None:
        if self.rows == self.want_rows and self.tokens == self.rows:
            self.steps.append(dict(self.current))


def instrument(llm, clock: PhaseClock) -> None:
    from minivllm.engine.detokenizer import IncrementalDetokenizer

    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    runner = core.executor.worker.model_runner

    schedule = scheduler.schedule

    def counted_schedule():
        out = schedule()
        clock.rows = len(out.num_scheduled_tokens)
        clock.tokens = out.total_num_scheduled_tokens
        return out

    scheduler.schedule = counted_schedule
    clock.wrap(scheduler, "schedule", "schedule")
    clock.wrap(scheduler, "update_from_output", "update_from_out")
    clock.wrap(runner, "execute_model", "execute_model")
    clock.wrap(runner, "_update_states", "update_states")
    clock.wrap(runner.input_batch, "prepare", "prepare")
    clock.wrap(runner.attn_backend, "build_metadata", "attn_metadata")
    clock.wrap(runner, "_forward", "forward")
    clock.wrap(runner.model, "compute_logits", "logits")
    clock.wrap(runner.sampling_inputs, "metadata", "sample")
    clock.wrap(runner, "sampler", "sample")
    clock.wrap(runner, "_output", "runner_output")
    clock.wrap(engine.output_processor, "process_outputs", "process_outputs")
    clock.wrap(IncrementalDetokenizer, "update", "detokenize")
    step = engine.step

    def timed_step():
        clock.begin()
        start = time.perf_counter()
        out = step()
        clock.current["step"] = time.perf_counter() - start
        clock.end()
        return out

    engine.step = timed_step
    gc.callbacks.append(clock.on_gc)


def derive(step: dict[str, float]) -> dict[str, float]:
    """The 'other' phases: a total less the phases timed inside it."""
    out = {p: step.get(p, 0.0) for p in PHASES}
    inner = ("update_states", "prepare", "attn_metadata", "forward", "logits", "sample")
    inner += ("runner_output",)
    out["runner_other"] = step.get("execute_model", 0.0) - sum(out[p] for p in inner)
    outer = ("schedule", "execute_model", "update_from_out", "process_outputs")
    out["step_other"] = out["step"] - sum(step.get(p, 0.0) for p in outer)
    return out


def run(llm, clock: PhaseClock, rows: int, args, profile: cProfile.Profile | None) -> list:
    from minivllm import SamplingParams
    from minivllm.sampling_params import RequestOutputKind

    rng = random.Random(rows)
    kind = {
        "final": RequestOutputKind.FINAL_ONLY,
        "delta": RequestOutputKind.DELTA,
        "cumulative": RequestOutputKind.CUMULATIVE,
    }[args.output_kind]
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.output_len,
        ignore_eos=True,
        output_kind=kind,
    )
    engine = llm.llm_engine
    for i in range(rows):
        ids = [rng.randrange(10, 2000) for _ in range(args.input_len)]
        engine.add_request(f"r{rows}-{i}-{time.monotonic_ns()}", {"prompt_token_ids": ids}, params)
    clock.want_rows = rows
    clock.steps = []
    if profile is not None:
        profile.enable()
    while engine.has_unfinished_requests():
        engine.step()
    if profile is not None:
        profile.disable()
    return [derive(s) for s in clock.steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--output-kind", choices=["final", "delta", "cumulative"], default="final")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each row count")
    parser.add_argument("--profile", action="store_true", help="cProfile the largest rows too")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", help="write the medians here")
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the start-up heap to the collector (an in-process LLM's frontend does)",
    )
    args = parser.parse_args()

    from minivllm import LLM

    folder = gpu_checkpoints.write_config("qwen3-0.6b", "float32", tiny=True)
    max_rows = max(args.rows)
    llm = LLM(
        folder,
        load_format="dummy",
        dtype="float32",
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=max_rows,
        max_num_batched_tokens=max(8192, max_rows * args.input_len),
        enable_prefix_caching=False,
        kv_cache_memory_bytes=1 << 30,
    )
    if not args.no_gc_freeze:  # as the engine core's process does once it is up
        gc.collect()
        gc.freeze()
    clock = PhaseClock()
    instrument(llm, clock)
    run(llm, clock, min(args.rows), args, None)  # warm-up: graphs, kernels, caches
    results: dict[int, dict[str, float]] = {}
    for rows in args.rows:
        steps = []
        for _ in range(args.repeat):
            steps += run(llm, clock, rows, args, None)
        results[rows] = {p: statistics.median(s[p] for s in steps) for p in PHASES}
        results[rows]["host"] = sum(results[rows][p] for p in HOST_PHASES)
        print(f"\n{rows} rows: {len(steps)} steady decode steps (medians)", flush=True)
        print(f"{'phase':<16} {'us/step':>10} {'us/req/step':>12} {'share':>7}")
        total = results[rows]["step"]
        for p in PHASES:
            us = 1e6 * results[rows][p]
            print(f"{p:<16} {us:>10.1f} {us / rows:>12.2f} {results[rows][p] / total:>7.1%}")
        host = results[rows]["host"]
        print(f"{'host':<16} {1e6 * host:>10.1f} {1e6 * host / rows:>12.2f}"
              "            (the host phases' medians, summed)")  # fmt: skip
    if args.profile:
        profile = cProfile.Profile()
        run(llm, clock, max_rows, args, profile)
        stats = pstats.Stats(profile).strip_dirs()
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumtime").print_stats(args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(r): v for r, v in results.items()}, f, indent=1)
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
