"""Offline throughput with each speed switch turned off, one at a time (the ablation).

Runs `minivllm bench throughput` (defaults: 256 prompts x 128 random token ids in, 128
out, ignore_eos, bundled model; extra arguments go to it) once per run in a fresh
process, cycling through the chosen settings (A B C A B C ...), and prints every run's
figures and each setting's median against the defaults.

    .venv/bin/python benchmarks/ablation.py --runs 3 --settings defaults,in-process
    .venv/bin/python benchmarks/ablation.py --runs 1 --model DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SETTINGS = {
    "defaults": {},  # the engine core in its own process, every switch on
    "in-process": {"MINIVLLM_ENABLE_MULTIPROCESSING": "0"},
    "no packed linear": {"MINIVLLM_CPU_PACKED_LINEAR": "0"},
    "no small-batch linear": {"MINIVLLM_CPU_SMALL_BATCH_LINEAR": "0"},
    "no attention kernel": {"MINIVLLM_CPU_ATTN_KERNEL": "0"},
    "no layer kernels": {"MINIVLLM_CPU_LAYER_KERNELS": "0"},
    "no CPU graphs": {"MINIVLLM_CPU_GRAPHS": "0"},
    "no freed-memory reuse": {"MINIVLLM_CPU_REUSE_FREED_MEMORY": "0"},
}


def run_once(setting: str, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, **SETTINGS[setting])
        command = [sys.executable, "-m", "minivllm.bench", "throughput"]
        command += ["--no-enable-prefix-caching", "--output-json", out.name, *extra]
        subprocess.run(command, env=env, check=True, stdout=sys.stderr)
        with open(out.name) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each setting")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated")
    args, extra = parser.parse_known_args()
    chosen = args.settings.split(",")
    results: dict[str, list[dict]] = {setting: [] for setting in chosen}
    for i in range(args.runs):
        for setting in chosen:
            result = run_once(setting, extra)
            results[setting].append(result)
            print(
                f"run {i + 1} {setting:>20}: {result['elapsed_time']:7.1f} s  "
                f"{result['requests_per_second']:.2f} req/s  "
                f"{result['tokens_per_second']:.1f} total tok/s  "
                f"{result['output_tokens_per_second']:.1f} output tok/s",
                flush=True,
            )
    medians = {
        setting: statistics.median(r["output_tokens_per_second"] for r in runs)
        for setting, runs in results.items()
    }
    base = medians.get("defaults")
    for setting, value in medians.items():
        versus = f"  ({value / base:.3f} x defaults)" if base else ""
        print(f"median {setting:>20}: {value:.1f} output tok/s{versus}")


if __name__ == "__main__":
    main()
