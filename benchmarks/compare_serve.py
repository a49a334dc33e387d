"""`vllm bench serve` (vLLM's own client, from the peer's virtualenv) against `minivllm serve`
and `vllm serve` on the same fp32 model, one server at a time.

For each engine: start its server, wait for /health, run the serve workload (random
dataset, 128 in / 128 out with ignore_eos, 64 requests) at each request rate, stop it.
Prints the client's TTFT / TPOT / ITL / E2E lines and saves its JSON results; with several
pairs (minivllm then vLLM in each), also the median of each figure over the pairs and
minivllm's ratio to vLLM (issue 19's acceptance: rates 4 and 8 and unlimited, 3 pairs).

    .venv/bin/python benchmarks/compare_serve.py --pairs 3 --out-dir /tmp/serve-bench
    .venv/bin/python benchmarks/compare_serve.py --pairs 1 --rates 4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from compare_vllm import PEER_ENV  # noqa: E402
from prepare_model import prepare  # noqa: E402

PORT = 8123
RATES = ("4", "8", "inf")
KEYS = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms", "p99_ttft_ms")


def start_server(engine: str, model: str, peer: str) -> subprocess.Popen:
    if engine == "minivllm":
        cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", model]
        cmd += ["--no-enable-prefix-caching"]
        env = dict(os.environ)
    else:
        cmd = [os.path.join(peer, "bin", "vllm"), "serve", model, "--dtype", "float32"]
        cmd += ["--no-enable-prefix-caching"]
        env = {**os.environ, **PEER_ENV}
    cmd += ["--host", "127.0.0.1", "--port", str(PORT)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    return wait_healthy(proc, PORT, 600, engine)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, name: str):
    """proc once its server on port answers /health with 200; raises if it exits first or
    takes longer than timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} server exited during start-up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{name} server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench(model: str, rate: str, peer: str, out: str) -> dict:
    cmd = [os.path.join(peer, "bin", "vllm"), "bench", "serve", "--backend", "openai"]
    cmd += ["--base-url", f"http://127.0.0.1:{PORT}", "--model", model]
    cmd += ["--dataset-name", "random", "--random-input-len", "128"]
    cmd += ["--random-output-len", "128", "--ignore-eos", "--num-prompts", "64"]
    cmd += ["--request-rate", rate, "--seed", "0", "--save-result"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el"]
    cmd += ["--result-dir", os.path.dirname(out), "--result-filename", os.path.basename(out)]
    printed = subprocess.run(cmd, env={**os.environ, **PEER_ENV}, capture_output=True, text=True)
    if printed.returncode != 0:
        tail = printed.stdout[-3000:] + printed.stderr[-3000:]
        raise RuntimeError(f"vllm bench serve failed:\n{tail}")
    start = printed.stdout.find("=====")
    print(printed.stdout[start:], flush=True)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--peer", default=os.path.expanduser("~/peer-vllm"))
    parser.add_argument("--out-dir", default="serve-bench")
    parser.add_argument("--rates", nargs="+", default=list(RATES), help="request rates")
    args = parser.parse_args()
    model = prepare()
    os.makedirs(args.out_dir, exist_ok=True)
    table = []
    for i in range(args.pairs):
        for engine in ("minivllm", "vllm"):
            proc = start_server(engine, model, args.peer)
            try:
                for rate in args.rates:
                    print(f"== pair {i + 1}, {engine} serve, request rate {rate}", flush=True)
                    out = os.path.abspath(os.path.join(args.out_dir, f"{engine}-{rate}-{i}.json"))
                    result = bench(model, rate, args.peer, out)
                    table.append((engine, rate, result))
            finally:
                stop_server(proc)
    print("engine    rate  done  out tok/s  " + "  ".join(KEYS))
    for engine, rate, r in table:
        figures = "  ".join(f"{r.get(k, float('nan')):.1f}" for k in KEYS)
        print(f"{engine:8s} {rate:>5} {r['completed']:5d} {r['output_throughput']:9.1f}  {figures}")
    if args.pairs > 1:
        print_medians(table, args.rates)


def print_medians(table: list[tuple[str, str, dict]], rates: list[str]) -> None:
    """Median over the pairs of each figure, and minivllm / vLLM."""
    keys = ("output_throughput", *KEYS)
    print("\nmedians over the pairs\nengine    rate  out tok/s  " + "  ".join(KEYS))
    medians = {}
    for engine in ("minivllm", "vllm", "ratio"):
        for rate in rates:
            if engine == "ratio":
                row = [medians["minivllm", rate][k] / medians["vllm", rate][k] for k in keys]
                print(f"{'mini/vllm':8s} {rate:>5} " + "  ".join(f"{v:9.3f}" for v in row))
                continue
            runs = [r for e, rt, r in table if e == engine and rt == rate]
            medians[engine, rate] = {
                k: statistics.median(r.get(k, float("nan")) for r in runs) for k in keys
            }
            row = [medians[engine, rate][k] for k in keys]
            print(f"{engine:8s} {rate:>5} " + "  ".join(f"{v:9.1f}" for v in row))


if __name__ == "__main__":
    main()
