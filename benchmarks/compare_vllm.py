"""Run minivllm and vLLM's CPU build alternately on the same workload; print the ratio.

Both load the same float32 HF directory (prepare_model.py). vLLM runs from its own
virtualenv (default ~/peer-vllm, see ../shared/BENCHMARKING.md) with both cores bound;
nothing is installed into the project's environment.

    python benchmarks/compare_vllm.py throughput --pairs 3
    python benchmarks/compare_vllm.py latency --pairs 3
    python benchmarks/compare_vllm.py throughput --pairs 3 --peer-engine hf

`--peer-engine hf` puts HF transformers' batched generate (hf_throughput.py, project venv)
in vLLM's place, for the throughput workload only.

Every run also records the peak resident memory of its whole process tree (frontend and
engine processes summed, sampled every 0.2 s). The latency workload runs each engine
twice per pair, 128 and 1 output tokens, and reports TPOT = (E2E_128 - E2E_1) / 127:
`vllm bench latency` prints only the end-to-end latency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from prepare_model import prepare  # noqa: E402

PEER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}
WORKLOADS = {
    # name: (bench args, json key, higher is better)
    "throughput": (
        # vLLM's random dataset reads --random-input-len (its --input-len is ignored there).
        [
            "throughput",
            "--dataset-name",
            "random",
            "--random-input-len",
            "128",
            "--random-output-len",
            "128",
            "--num-prompts",
            "256",
        ],
        "output_tokens_per_second",
        True,
    ),
    "latency": (
        [
            "latency",
            "--input-len",
            "128",
            "--batch-size",
            "1",
            "--num-iters-warmup",
            "1",
            "--num-iters",
            "5",
        ],
        "avg_latency",
        False,
    ),
}
LATENCY_OUTPUT_LENS = (128, 1)


def _tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def run_measured(cmd: list[str], env: dict) -> tuple[float, int]:
    """(wall seconds, peak tree RSS in bytes) of one command."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0

    def sample() -> None:
        nonlocal peak
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    sampler.join()
    return time.perf_counter() - start, peak


def run(engine: str, args: list[str], key: str, model: str, peer: str) -> tuple[float, float, int]:
    """(figure, wall seconds including start-up, peak RSS bytes) of one run of one engine."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    common = ["--model", model, "--no-enable-prefix-caching", "--output-json", out]
    if engine == "minivllm":
        cmd = [sys.executable, "-m", "minivllm.bench", *args, *common]
        env = dict(os.environ)
    elif engine == "hf":
        script = os.path.join(os.path.dirname(__file__), "hf_throughput.py")
        # args[0] names the vllm/minivllm bench subcommand; the workload flags follow.
        cmd = [sys.executable, script, *args[1:], "--model", model, "--output-json", out]
        env = dict(os.environ)
    else:
        cmd = [os.path.join(peer, "bin", "vllm"), "bench", *args, *common, "--dtype", "float32"]
        env = {**os.environ, **PEER_ENV}
    wall, peak = run_measured(cmd, env)
    with open(out) as f:
        result = json.load(f)
    if key == "output_tokens_per_second" and key not in result:
        # vLLM's JSON has no output rate; with ignore_eos every request makes all its tokens.
        output_len = int(args[args.index("--random-output-len") + 1])
        result[key] = result["num_requests"] * output_len / result["elapsed_time"]
    return result[key], wall, peak


def run_pair_member(engine: str, workload: str, model: str, peer: str) -> dict:
    args, key, _ = WORKLOADS[workload]
    if workload != "latency":
        value, wall, peak = run(engine, args, key, model, peer)
        print(f"  {engine:8s} {key} = {value:.3f}  peak RSS {peak / 2**30:.2f} GiB  ({wall:.0f} s)")
        return {key: value, "peak_rss_gib": peak / 2**30}
    e2e = {}
    peaks = []
    for n in LATENCY_OUTPUT_LENS:
        e2e[n], wall, peak = run(engine, [*args, "--output-len", str(n)], key, model, peer)
        peaks.append(peak)
        print(f"  {engine:8s} {n:3d} out: E2E {e2e[n] * 1e3:.1f} ms  ({wall:.0f} s)")
    long, short = LATENCY_OUTPUT_LENS
    tpot = (e2e[long] - e2e[short]) / (long - short)
    print(f"  {engine:8s} TPOT {tpot * 1e3:.2f} ms  peak RSS {max(peaks) / 2**30:.2f} GiB")
    return {
        "tpot": tpot,
        "e2e_128": e2e[long],
        "e2e_1": e2e[short],
        "peak_rss_gib": max(peaks) / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--peer", default=os.path.expanduser("~/peer-vllm"))
    parser.add_argument("--model", default=None, help="HF dir (default: prepared SmolLM2 fp32)")
    parser.add_argument("--output-json", default=None, help="write every run's figures here")
    parser.add_argument("--peer-engine", choices=("vllm", "hf"), default="vllm")
    args = parser.parse_args()
    if args.peer_engine == "hf" and args.workload != "throughput":
        parser.error("--peer-engine hf runs the throughput workload only")
    model = args.model or prepare()
    peer = args.peer_engine
    runs: dict[str, list[dict]] = {"minivllm": [], peer: []}
    for i in range(args.pairs):
        print(f"pair {i + 1}", flush=True)
        for engine in ("minivllm", peer):
            runs[engine].append(run_pair_member(engine, args.workload, model, args.peer))
    _, key, higher_is_better = WORKLOADS[args.workload]
    figures = [(key, higher_is_better)] if args.workload != "latency" else [("tpot", False)]
    figures += [("e2e_128", False)] if args.workload == "latency" else []
    figures.append(("peak_rss_gib", False))
    summary = {}
    for name, higher in figures:
        ours, theirs = (statistics.median(r[name] for r in runs[e]) for e in ("minivllm", peer))
        ratio = ours / theirs if higher else theirs / ours
        summary[name] = {"minivllm": ours, peer: theirs, "advantage": ratio}
        print(
            f"median {name}: minivllm {ours:.4g}, {peer} {theirs:.4g}; "
            f"minivllm is {ratio:.2f}x {peer} (above 1 is better)"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"workload": args.workload, "runs": runs, "median": summary}, f, indent=2)


if __name__ == "__main__":
    main()
