"""Where one stream's decode step spends its time: cProfile over the engine core run in
this process (MINIVLLM_ENABLE_MULTIPROCESSING=0), CUDA graphs on and off, on the
Qwen3-0.6B-shaped bf16 checkpoint of gpu_bench.py. Prints the top functions by own time
and by cumulative time, and the seconds per step.

    python benchmarks/gpu_profile.py            # on the GPU
    python benchmarks/gpu_profile.py --tiny     # on a CPU, to debug this
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import time

os.environ["MINIVLLM_ENABLE_MULTIPROCESSING"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_checkpoints  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--async-scheduling", action="store_true", help="graphs on only")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="the device's kernels of one stream's decode steps (torch.profiler), not cProfile",
    )
    parser.add_argument(
        "--standard",
        action="store_true",
        help="the standard workload (256 x 128 in, 128 out, temperature 1), not one stream",
    )
    args = parser.parse_args()
    from minivllm import LLM, SamplingParams

    device, dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
    folder = gpu_checkpoints.write_checkpoint("qwen3-0.6b", dtype, tiny=args.tiny)
    prompts = [{"prompt_token_ids": list(range(100, 228))}]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    steps = args.tokens
    if args.standard:  # as gpu_bench.py's: 256 prompts of 128 random ids, 128 out each
        rng = random.Random(0)
        n, length = (8, 16) if args.tiny else (256, 128)
        prompts = [{"prompt_token_ids": [rng.randrange(10, 2000) for _ in range(length)]}
                   for _ in range(n)]  # fmt: skip
        params = SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True)
        steps = length
    for eager in (False,) if args.async_scheduling else (False, True):
        llm = LLM(folder, device=device, dtype=dtype, max_model_len=1024,
                  enable_prefix_caching=False, enforce_eager=eager,
                  async_scheduling=args.async_scheduling)  # fmt: skip
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        if args.kernels:
            kernels(llm, prompts, params, steps, args)
        else:
            profile = cProfile.Profile()
            start = time.perf_counter()
            profile.enable()
            llm.generate(prompts, params, use_tqdm=False)
            profile.disable()
            elapsed = time.perf_counter() - start
            print(f"\n##### enforce_eager={eager}, async_scheduling={args.async_scheduling}: "
                  f"{1e3 * elapsed / steps:.2f} ms a step (profiled)", flush=True)  # fmt: skip
            stats = pstats.Stats(profile).strip_dirs()
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumtime").print_stats(args.top)
        llm.llm_engine.shutdown()
        del llm


def kernels(llm, prompts, params, steps: int, args) -> None:
    """The device's kernels over one generate call (a CUDA graph's kernels are reported
    one by one): each kernel's count and time, and the device time a step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    print(f"\n##### kernels: {1e3 * elapsed / steps:.2f} ms a step (profiled), device "
          f"{device_us / 1e3 / steps:.3f} ms a step", flush=True)  # fmt: skip
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=70))


if __name__ == "__main__":
    main()
