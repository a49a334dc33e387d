"""One stream's decode rate on a quiet machine and beside a busy loop on one core (issue
#47): how much of its speed the engine keeps when a laptop also runs a browser, for each
OpenMP wait policy and thread setting, and llama.cpp's under the same load.

    python benchmarks/busy_decode.py                      # every policy, 3 rounds
    python benchmarks/busy_decode.py --policies bounded/auto --rounds 5 --llamacpp  # defaults

Each configuration runs in a fresh process (libgomp reads its wait policy when it loads),
the bundled model quantized (gguf), 64 tokens of one greedy stream after a warm-up;
quiet and busy alternate inside each round. It prints tokens/s and the busy/quiet ratio
per configuration (medians). llama.cpp: `llama-bench -p 0 -n 64 -t 2` from
benchmarks/gguf_llamacpp.sh's build ($LLAMACPP, /work/llamacpp by default), quiet and busy.
The machine should be otherwise idle: the busy loop must be the only competitor.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (name, environment): the wait policies, with a fixed thread count per core and with the
# thread count that follows the free cores.
CONFIGS = {
    "spin/fixed": {"MINIVLLM_CPU_OMP_WAIT_POLICY": "spin", "MINIVLLM_CPU_THREADS_FOLLOW_LOAD": "0"},
    "bounded/fixed": {
        "MINIVLLM_CPU_OMP_WAIT_POLICY": "bounded",
        "MINIVLLM_CPU_THREADS_FOLLOW_LOAD": "0",
    },
    "passive/fixed": {
        "MINIVLLM_CPU_OMP_WAIT_POLICY": "passive",
        "MINIVLLM_CPU_THREADS_FOLLOW_LOAD": "0",
    },
    # The defaults (envs.py): a bounded spin, and the thread count following the free cores.
    "bounded/auto": {
        "MINIVLLM_CPU_OMP_WAIT_POLICY": "bounded",
        "MINIVLLM_CPU_THREADS_FOLLOW_LOAD": "1",
    },
    "passive/auto": {
        "MINIVLLM_CPU_OMP_WAIT_POLICY": "passive",
        "MINIVLLM_CPU_THREADS_FOLLOW_LOAD": "1",
    },
    "one-thread": {"MINIVLLM_CPU_OMP_WAIT_POLICY": "spin", "OMP_NUM_THREADS": "1"},
}
TOKENS = 64


def child(rounds: int) -> None:
    """In the configuration's process: quiet and busy decode rates, alternating."""
    from minivllm import LLM, SamplingParams
    from tests.busy import busy_cores

    llm = LLM(enable_multiprocessing=False, max_model_len=512, quantization="gguf")
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    platform = llm.llm_engine.engine_core.engine_core.executor.worker.platform

    def rate() -> float:
        llm.generate("The history of the sea", SamplingParams(max_tokens=2), use_tqdm=False)
        start = time.perf_counter()
        llm.generate("Tell me about the sea.", params, use_tqdm=False)
        return TOKENS / (time.perf_counter() - start)

    rate()  # warm-up
    results = {"quiet": [], "busy": []}
    for _ in range(rounds):
        results["quiet"].append(rate())
        with busy_cores():
            time.sleep(2.5)  # long enough for `auto` threads to see the loop
            results["busy"].append(rate())
        time.sleep(2.5)  # and to see it gone
    auto = getattr(platform, "_auto_threads", None)
    results["threads_at_end"] = auto.threads if auto is not None else None
    print("RESULT " + json.dumps(results), flush=True)


def llamacpp(rounds: int) -> dict | None:
    from minivllm.model.loader import default_model_path
    from tests.busy import busy_cores

    binary = os.path.join(os.environ.get("LLAMACPP", "/work/llamacpp"), "build/bin/llama-bench")
    if not os.path.exists(binary):
        print(f"no {binary}: run benchmarks/gguf_llamacpp.sh build", file=sys.stderr)
        return None
    command = [binary, "-m", default_model_path(), "-p", "0", "-n", str(TOKENS), "-t", "2"]
    command += ["-r", "1", "-o", "json"]

    def rate() -> float:
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        return float(re.search(r'"avg_ts":\s*([0-9.]+)', out).group(1))

    results = {"quiet": [], "busy": []}
    for _ in range(rounds):
        results["quiet"].append(rate())
        with busy_cores():
            results["busy"].append(rate())
    return results


def summary(name: str, results: dict) -> None:
    quiet, busy = statistics.median(results["quiet"]), statistics.median(results["busy"])
    print(
        f"{name:16s} quiet {quiet:7.1f} tok/s  busy {busy:7.1f} tok/s  "
        f"busy/quiet {busy / quiet:5.0%}  (runs: {results['quiet']}, {results['busy']})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llamacpp", action="store_true", help="llama.cpp too")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.rounds)
        return
    for name in args.policies:
        env = {**os.environ, **CONFIGS[name], "PYTHONPATH": ROOT}
        for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
            if var not in CONFIGS[name]:
                env.pop(var, None)
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--rounds", str(args.rounds)],
            env=env,
            capture_output=True,
            text=True,
        )
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed\n{out.stderr[-2000:]}")
            continue
        results = json.loads(line[len("RESULT ") :])
        summary(name, results)
    if args.llamacpp:
        results = llamacpp(args.rounds)
        if results:
            summary("llama.cpp -t 2", results)


if __name__ == "__main__":
    main()
