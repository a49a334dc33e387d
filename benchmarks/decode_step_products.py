#!/usr/bin/env python
"""One stream's decode step against its weight products alone, in one process, alternating
(issue 50: where the step's time goes beside the products).

    python benchmarks/decode_step_products.py MODEL.gguf [--threads 2] [--rounds 5]
        [--tokens 32]

Loads MODEL in-process (the engine's own step: CPU graphs unless --enforce-eager), then
alternates, each round: a decode of --tokens tokens after a one-token prompt (ms a step;
the layers' replay and the LM head timed apart, the rest is the engine's host work),
and the same number of passes over every packed GGUF product of the model in forward order
(LM head last), each called through the C entry point on one activation row, as a replayed
step calls it. It prints both in ms a step, their difference (what the step spends beside
the products: norms, convolutions, attention, activations, sampling, the host), and each
product shape's GB/s of weight bytes. The machine may be shared: compare the shares within
one run (the medians of the rounds), not absolute rates across runs.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gguf_hybrid_shape import minivllm_rates, runner_of  # noqa: E402

from minivllm.model.layers.quantization.base import quantized_weight  # noqa: E402
from minivllm.model.layers.quantization.gguf import GGUFLinearMethod, GGUFWeight  # noqa: E402
from minivllm.worker.cpu_graph import _KernelRun  # noqa: E402


def timed(owner, name: str, seconds: list[float]) -> None:
    """Wrap owner.name (an instance attribute over the method) to add its wall time to
    seconds[0]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def graph_calls(llm) -> str:
    """The one-stream step's CPU graph: its C kernel calls (each product, norm, convolution,
    ... one; most a parallel region) and the torch ops it replays from Python."""
    runner = runner_of(llm)
    for graph in (runner.cpu_graphs or {}).values():
        if graph is None:
            continue
        kernels = sum(len(c.twins) for c in graph.program if isinstance(c, _KernelRun))
        python = sum(1 for c in graph.program if not isinstance(c, _KernelRun))
        return f"CPU graph: {kernels} kernel calls a step, {python} from Python"
    return "no CPU graph (eager steps)"


def products(model: torch.nn.Module) -> list[tuple[str, GGUFWeight]]:
    """(name, weight) of every packed GGUF product in forward order; a tied weight once."""
    seen, found = set(), []
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), GGUFLinearMethod):
            continue
        weight = quantized_weight(module.weight)
        if isinstance(weight, GGUFWeight) and weight.packed_calls and id(weight) not in seen:
            seen.add(id(weight))
            found.append((name, weight))
    return found


def product_calls(
    found: list[tuple[str, GGUFWeight]], buffers: list[torch.Tensor]
) -> list[tuple[tuple, tuple, int]]:
    """(shape (n, k), the kernel's arguments, weight bytes) of every segment's call; the
    activation and output rows the calls point into go to buffers (kept alive there)."""
    calls = []
    for _, w in found:
        k, n = w.in_features, w.out_features
        x, y = torch.randn(1, k), torch.empty(1, n)
        buffers += [x, y]
        for (qtype, ptr, rows, offset), (_, t) in zip(w.packed_calls, w.segments, strict=True):
            args = (qtype, ptr, rows, k, x.data_ptr(), 1, y.data_ptr() + 4 * offset, n)
            calls.append(((n, k), (w.kernel, args), t.raw.numel()))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from minivllm import LLM

    llm = LLM(
        args.model,
        quantization="gguf",
        max_model_len=1024,
        enable_prefix_caching=False,
        enable_multiprocessing=False,
        enforce_eager=args.enforce_eager,
    )
    buffers: list[torch.Tensor] = []
    calls = product_calls(products(runner_of(llm).model), buffers)
    weight_bytes = sum(b for _, _, b in calls)
    minivllm_rates(llm, 128, 4)  # warm-up: the graph's capture
    runner = runner_of(llm)
    forward, head = [0.0], [0.0]  # the layers (the graph's replay), the LM head
    timed(runner, "_forward", forward)
    timed(runner.model, "compute_logits", head)
    step_ms, product_ms, forward_ms, head_ms = [], [], [], []
    per_shape = collections.defaultdict(list)  # shape -> seconds of each round's calls
    bytes_of = collections.Counter()
    for shape, _, b in calls:
        bytes_of[shape] += b
    for _ in range(args.rounds):
        # A one-token prompt: its step is a decode step too, so that every forward the
        # wrappers time is one (tokens + 1 of them; the rate leaves out the first).
        forward[0] = head[0] = 0.0
        rate = minivllm_rates(llm, 1, args.tokens + 1)[1]
        step_ms.append(1e3 / rate)
        forward_ms.append(forward[0] * 1e3 / (args.tokens + 1))
        head_ms.append(head[0] * 1e3 / (args.tokens + 1))
        seconds = collections.Counter()
        start = time.perf_counter()
        for _ in range(args.tokens):
            for shape, (kernel, a), _ in calls:
                t0 = time.perf_counter()
                kernel(*a)
                seconds[shape] += time.perf_counter() - t0
        product_ms.append((time.perf_counter() - start) * 1e3 / args.tokens)
        for shape, s in seconds.items():
            per_shape[shape].append(s / args.tokens)
    step, prod = statistics.median(step_ms), statistics.median(product_ms)
    print(f"threads {torch.get_num_threads()}, {len(calls)} products a step, "
          f"{weight_bytes / 1e6:.1f} MB of weights; {graph_calls(llm)}")  # fmt: skip
    print(f"decode step {step:.2f} ms ({weight_bytes / step / 1e6:.1f} GB/s), rounds "
          + ", ".join(f"{v:.2f}" for v in step_ms))  # fmt: skip
    print(f"products alone {prod:.2f} ms ({weight_bytes / prod / 1e6:.1f} GB/s), rounds "
          + ", ".join(f"{v:.2f}" for v in product_ms))  # fmt: skip
    print(f"beside the products: {step - prod:.2f} ms a step ({(step - prod) / step:.0%})")
    fwd, lm = statistics.median(forward_ms), statistics.median(head_ms)
    print(
        f"of the step: the layers {fwd:.2f} ms (the graph's replay), the LM head {lm:.2f}, "
        f"the rest (inputs, sampling, the engine's host work) {step - fwd - lm:.2f}"
    )
    for shape, runs in sorted(per_shape.items(), key=lambda kv: -bytes_of[kv[0]]):
        s = statistics.median(runs)
        count = sum(1 for c in calls if c[0] == shape)
        print(
            f"  {shape[0]:>6} x {shape[1]:<5} x{count:<3} {s * 1e3:6.2f} ms a step, "
            f"{bytes_of[shape] / s / 1e9:5.1f} GB/s, {s / count * 1e6:6.0f} us a call"
        )


if __name__ == "__main__":
    main()
