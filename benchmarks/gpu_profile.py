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
    args = parser.parse_args()
    from minivllm import LLM, SamplingParams

    device, dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
    folder = gpu_checkpoints.write_checkpoint("qwen3-0.6b", dtype, tiny=args.tiny)
    prompt = {"prompt_token_ids": list(range(100, 228))}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for eager in (False,) if args.async_scheduling else (False, True):
        llm = LLM(folder, device=device, dtype=dtype, max_model_len=1024,
                  enable_prefix_caching=False, enforce_eager=eager,
                  async_scheduling=args.async_scheduling)  # fmt: skip
        llm.generate([prompt], params, use_tqdm=False)  # warm-up
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        llm.generate([prompt], params, use_tqdm=False)
        profile.disable()
        elapsed = time.perf_counter() - start
        print(f"\n##### enforce_eager={eager}, async_scheduling={args.async_scheduling}: "
              f"{1e3 * elapsed / args.tokens:.2f} ms a step (profiled)", flush=True)  # fmt: skip
        stats = pstats.Stats(profile).strip_dirs()
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumtime").print_stats(args.top)
        llm.llm_engine.shutdown()
        del llm


if __name__ == "__main__":
    main()
