"""Offline throughput through the multiprocess client vs the in-process client.

Runs `minivllm bench throughput` (256 prompts x 128 random token ids in, 128 out, greedy,
ignore_eos, bundled model) once per run in a fresh process, alternating
MINIVLLM_ENABLE_MULTIPROCESSING=1 and =0 (A B A B ...), and prints every run's figures.

    .venv/bin/python benchmarks/throughput_mp_vs_inproc.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODES = {"multiprocess": "1", "in-process": "0"}


def run_once(mode: str, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, MINIVLLM_ENABLE_MULTIPROCESSING=MODES[mode])
        command = [sys.executable, "-m", "minivllm.bench", "throughput"]
        command += ["--no-enable-prefix-caching", "--output-json", out.name, *extra]
        subprocess.run(command, env=env, check=True, stdout=sys.stderr)
        with open(out.name) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each client")
    args, extra = parser.parse_known_args()
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i in range(args.runs):
        for mode in MODES:
            result = run_once(mode, extra)
            results[mode].append(result)
            print(
                f"run {i + 1} {mode:>12}: {result['elapsed_time']:7.1f} s  "
                f"{result['requests_per_second']:.2f} req/s  "
                f"{result['tokens_per_second']:.1f} total tok/s  "
                f"{result['output_tokens_per_second']:.1f} output tok/s",
                flush=True,
            )
    medians = {
        mode: statistics.median(r["output_tokens_per_second"] for r in runs)
        for mode, runs in results.items()
    }
    for mode, value in medians.items():
        print(f"median {mode:>12}: {value:.1f} output tok/s")
    print(f"multiprocess / in-process: {medians['multiprocess'] / medians['in-process']:.3f}")


if __name__ == "__main__":
    main()
