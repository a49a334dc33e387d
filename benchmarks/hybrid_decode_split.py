"""Where one stream's decode step of a hybrid GGUF goes (issue 50, acceptance 4): the whole
engine step against the replayed CPU graph inside it, and the graph's Q4 products against
the rest of its kernels (the gated delta rule, convolution, norms, attention).

Runs minivllm in-process on the file gguf_hybrid_shape.py writes, at the same settings as
its --vs-llamacpp run, decodes one stream after a 128-token prompt and prints, in ms a step:

- ``engine step``: LLMEngine.step() of a decode (what gguf_hybrid_shape.py's rate measures);
- ``graph replay``: the captured decode step inside it (the layers, not the LM head);
- ``outside``: the two's difference: the LM head, sampling and the engine's Python;
- then the graph's calls replayed from here in three programs, alternating: ``all`` of
  them, only the ``products`` (gguf_packed_matmul) and only the ``rest``; and each kind of
  call alone in the step's order (min over the repetitions, with ~2 us of ctypes each).

Minimums and medians: on a shared machine the minimums are the ones to compare (a step of
~280 parallel regions is hit by every preemption); on a quiet machine both should agree.
Run it with --threads 1 and --threads 2: what the second thread buys in each part.

    .venv/bin/python benchmarks/gguf_hybrid_shape.py --shape qwen35 --out /tmp/gguf3-qwen35-q4.gguf
    .venv/bin/python benchmarks/hybrid_decode_split.py /tmp/gguf3-qwen35-q4.gguf --threads 2
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import numpy as np
from gguf_hybrid_shape import hybrid_engine, runner_of

os.environ.setdefault("MINIVLLM_CPU_THREADS_FOLLOW_LOAD", "0")  # the count asked, throughout


def _ms(values: list[float]) -> str:
    a = np.array(values) * 1e3
    return f"min {a.min():6.2f}  median {np.median(a):6.2f}"


def engine_steps(llm, cpu_graph, decode: int) -> tuple[list[float], list[float], list]:
    """(engine step s, graph replay s, the last replay's attention metadata) of one stream's
    decode steps after a 128-token prompt."""
    from minivllm import SamplingParams

    replays: list[float] = []
    kept: list = []
    plain = cpu_graph.CPUGraph.replay

    def timed(self, embeds, attn_metadata):
        kept[:] = [attn_metadata]  # its block table and lengths: the programs below read them
        start = time.perf_counter()
        out = plain(self, embeds, attn_metadata)
        replays.append(time.perf_counter() - start)
        return out

    cpu_graph.CPUGraph.replay = timed
    try:
        engine = llm.llm_engine
        ids = np.random.default_rng(128).integers(100, 40000, size=128).tolist()
        params = SamplingParams(max_tokens=decode, ignore_eos=True, temperature=0.0)
        engine.add_request(f"split-{time.perf_counter()}", {"prompt_token_ids": ids}, params)
        steps = []
        while engine.has_unfinished_requests():
            replays.clear()
            start = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - start, sum(replays), len(replays)))
    finally:
        cpu_graph.CPUGraph.replay = plain
    decodes = [(s, r) for s, r, n in steps if n == 1]
    return [s for s, _ in decodes], [r for _, r in decodes], kept


def kernel_names() -> dict[int, str]:
    """Slot-twin address -> kernel name, for the libraries a hybrid's step calls."""
    from minivllm.kernels import conv_kernels, cpu_kernels, gated_delta_cpu, gguf_kernels

    libs = [
        cpu_kernels.load_library(),
        gated_delta_cpu.load_kernel(),
        gguf_kernels.load_gguf_kernels(),
        conv_kernels.load_conv_kernels(),
    ]
    names = {}
    for lib in filter(None, libs):
        for name, value in vars(lib).items():
            twin = getattr(value, "slots", None)
            if isinstance(twin, int):
                names[twin] = name
    return names


def split_programs(graph, cpu_graph, names: dict[int, str]) -> dict[str, list]:
    """The graph's kernel runs as (count, twins, starts, slots) programs: all, the products,
    the rest; and each call alone."""
    runs = [c for c in graph.program if isinstance(c, cpu_graph._KernelRun)]

    def program(keep) -> list:
        out = []
        for run in runs:
            chosen = [i for i, t in enumerate(run.twins) if keep(names.get(int(t), "?"))]
            if chosen:
                twins = np.ascontiguousarray(run.twins[chosen])
                out.append((len(chosen), twins, np.ascontiguousarray(run.starts[chosen]), run))
        return out

    calls = [
        (names.get(int(run.twins[i]), "?"), (1, run.twins[i : i + 1].copy(),
                                              run.starts[i : i + 1].copy(), run))
        for run in runs
        for i in range(len(run.twins))
    ]  # fmt: skip
    return {
        "all": program(lambda n: True),
        "products": program(lambda n: n.startswith("gguf_packed_matmul")),
        "rest": program(lambda n: not n.startswith("gguf_packed_matmul")),
        "calls": calls,
    }


def replay_programs(programs: dict[str, list], repeats: int) -> None:
    from minivllm.kernels import cpu_kernels

    run_calls = cpu_kernels.load_library().run_calls

    def go(program) -> None:
        for count, twins, starts, run in program:
            run_calls(count, twins.ctypes.data, run.slots.ctypes.data, starts.ctypes.data)

    times: dict[str, list[float]] = {k: [] for k in ("all", "products", "rest")}
    for _ in range(repeats):
        for name in times:
            start = time.perf_counter()
            go(programs[name])
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        calls = sum(p[0] for p in programs[name])
        print(f"replayed {name:8s} ({calls:3d} calls): {_ms(values)} ms")
    alone: list[list[float]] = [[] for _ in programs["calls"]]
    for _ in range(max(repeats // 2, 1)):
        for i, (_, call) in enumerate(programs["calls"]):
            start = time.perf_counter()
            go([call])
            alone[i].append(time.perf_counter() - start)
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for (name, (_, _, starts, run)), values in zip(programs["calls"], alone, strict=True):
        kind = name
        if name.startswith("gguf_packed_matmul"):  # qtype, weight rows n, k: its slots 0, 2, 3
            at = int(starts[0])
            kind += " type {} [{} x {}]".format(*(int(run.slots[at + j]) for j in (0, 2, 3)))
        by_kind[kind][0] += 1
        by_kind[kind][1] += min(values)
    total = sum(v[1] for v in by_kind.values())
    print(f"each call alone, in order (min each; sum {total * 1e3:.2f} ms):")
    for kind, (count, seconds) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind:48s} x{count:3d}  {seconds * 1e3:7.3f} ms  {seconds / count * 1e6:7.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("gguf")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--kv-cache-dtype", default="int8")
    parser.add_argument("--decode", type=int, default=64, help="tokens a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=100, help="of each replayed program")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from minivllm.worker import cpu_graph

    llm = hybrid_engine(args.gguf, args.decode, args.kv_cache_dtype)
    engine_steps(llm, cpu_graph, 4)  # warm-up and the graph's capture
    for round_ in range(args.rounds):
        steps, replays, kept = engine_steps(llm, cpu_graph, args.decode)
        outside = [s - r for s, r in zip(steps, replays, strict=True)]
        print(f"round {round_ + 1}, threads {torch.get_num_threads()}: engine step "
              f"{_ms(steps)}, graph replay {_ms(replays)}, outside {_ms(outside)} ms")  # fmt: skip
    graphs = [g for g in (runner_of(llm).cpu_graphs or {}).values() if g is not None]
    if not graphs:
        print("no CPU graph was captured: the decode steps ran eagerly")
        return
    replay_programs(split_programs(graphs[0], cpu_graph, kernel_names()), args.repeats)
    del kept


if __name__ == "__main__":
    main()
