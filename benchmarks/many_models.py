"""A many-model server (issue 52): what another model's load costs a loaded one, how fast a
dozing model wakes, and whether load/unload cycles leak.

    python benchmarks/many_models.py                       # all three, the bundled model
    python benchmarks/many_models.py --only ttft --rounds 10
    python benchmarks/many_models.py --only cycles --cycles 200

It serves a folder holding the bundled GGUF under two names (a, b) with
`minivllm serve --models-dir` and measures through HTTP:

- ttft: model a loaded and idle; a's time to first token (streamed, 16 tokens) with
  nothing else happening, then while another model's engine core starts: b again (loaded
  once before, unloaded between rounds: the server keeps its tokenizer) and a model never
  started before (first0, first1, ...: its tokenizer is built too). Acceptance: the median
  during a start within 1.5x of idle.
- doze: --keep-alive 1 --doze-window 30: a request 1 s after the keep-alive ended (the
  model dozes: KV cache dropped, weights loaded) against one to an awake model, and the
  engine core's RSS awake vs dozing. Acceptance: first token within 0.5 s; the dozing RSS
  lower by the KV cache (MINIVLLM_CPU_KVCACHE_SPACE GiB).
- cycles: POST /models/load a, a request, POST /models/unload a, N times; the server's
  engine core processes after the unloads and the process tree's RSS at cycle 10 and at the
  end. Acceptance: no engine core left after an unload; RSS at the end within 5% of cycle 10.

Run it on an otherwise idle machine (the figures are latencies).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import psutil  # noqa: E402

from tests.entrypoints.openai.utils import RemoteServer, request  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."


def ttft(server: RemoteServer, model: str, max_tokens: int = 16) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = json.dumps(
        {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
         "temperature": 0, "ignore_eos": True}
    ).encode()  # fmt: skip
    req = urllib.request.Request(
        server.url_for("v1/completions"), data=body, headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as response:
        for line in response:
            if first is None and line.startswith(b"data: {") and b'"text":""' not in line:
                first = time.perf_counter() - start
    return first if first is not None else float("nan")


def post(server: RemoteServer, path: str, body: dict) -> dict:
    status, _, data = request("POST", server.url_for(path), body, timeout=600)
    assert status == 200, data
    return json.loads(data)


def states(server: RemoteServer) -> dict[str, str]:
    _, _, data = request("GET", server.url_for("v1/models"))
    return {card["id"]: card["state"] for card in json.loads(data)["data"]}


def core_pids(server: RemoteServer) -> dict[str, int]:
    _, _, data = request("GET", server.url_for("health"))
    return {k: v["pid"] for k, v in json.loads(data)["models"].items() if "pid" in v}


def engine_cores(server: RemoteServer) -> int:
    """The server's engine core processes (multiprocessing's resource tracker aside)."""
    return sum(
        any("spawn_main" in part for part in p.cmdline())
        for p in psutil.Process(server.proc.pid).children(recursive=True)
    )


def tree_rss(server: RemoteServer) -> int:
    root = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def models_dir(first_loads: int = 0) -> str:
    """a and b, and first0.. (never loaded before: their first start builds their tokenizer
    in the frontend, which a model's later starts reuse)."""
    from minivllm.model.loader import default_model_path

    folder = tempfile.mkdtemp(prefix="minivllm-models-")
    for name in ("a", "b", *(f"first{i}" for i in range(first_loads))):
        os.symlink(default_model_path(), os.path.join(folder, f"{name}.gguf"))
    return folder


def bench_ttft(rounds: int) -> None:
    server = RemoteServer(["--models-dir", models_dir(rounds), "--max-model-len", "2048"])
    try:
        post(server, "models/load", {"model": "a"})
        ttft(server, "a")  # warm-up
        post(server, "models/load", {"model": "b"})  # b's later starts are reloads
        idle = []
        series = {"b reloads": [], "a model's first start": []}
        for i in range(rounds):
            for what, other in (("b reloads", "b"), ("a model's first start", f"first{i}")):
                idle.append(ttft(server, "a"))
                post(server, "models/unload", {"model": "b"})
                loader = threading.Thread(
                    target=post, args=(server, "models/load", {"model": other})
                )
                loader.start()
                time.sleep(0.3)  # its core is spawning and importing
                series[what].append(ttft(server, "a"))
                loader.join()
                post(server, "models/unload", {"model": other})
        i = statistics.median(idle)
        print(f"ttft a idle: {i * 1000:.0f} ms (median of {len(idle)})")
        for what, loading in series.items():
            lo = statistics.median(loading)
            print(f"  while {what}: {lo * 1000:.0f} ms, ratio {lo / i:.2f} (acceptance <= 1.5); "
                  "each: " + " ".join(f"{t * 1000:.0f}" for t in loading))  # fmt: skip
    finally:
        server.stop()


def bench_doze(rounds: int) -> None:
    server = RemoteServer(
        ["--models-dir", models_dir(), "--max-model-len", "2048", "--keep-alive", "1",
         "--doze-window", "30"]
    )  # fmt: skip
    try:
        awake, woken = [], []
        for _ in range(rounds):
            ttft(server, "a")  # loaded (first round) or woken
            awake.append(ttft(server, "a"))
            pid = core_pids(server)["a"]
            rss_awake = psutil.Process(pid).memory_info().rss
            while states(server)["a"] != "dozing":
                time.sleep(0.05)
            time.sleep(1.0)  # a request 1 s after the keep-alive ended
            rss_dozing = psutil.Process(pid).memory_info().rss
            woken.append(ttft(server, "a"))
            print(f"rss awake {rss_awake / 2**20:.0f} MiB, dozing {rss_dozing / 2**20:.0f} MiB")
        print(f"ttft awake: {statistics.median(awake) * 1000:.0f} ms; woken from doze: "
              f"{statistics.median(woken) * 1000:.0f} ms (acceptance <= 500)")  # fmt: skip
    finally:
        server.stop()


def bench_cycles(cycles: int) -> None:
    server = RemoteServer(["--models-dir", models_dir(), "--max-model-len", "512"])
    try:
        rss_at_10 = None
        for cycle in range(1, cycles + 1):
            post(server, "models/load", {"model": "a"})
            ttft(server, "a", max_tokens=2)
            post(server, "models/unload", {"model": "a"})
            cores = engine_cores(server)
            if cycle == 10:
                rss_at_10 = tree_rss(server)
            if cycle % 10 == 0:
                print(f"cycle {cycle}: {cores} engine cores after the unload, "
                      f"tree RSS {tree_rss(server) / 2**20:.0f} MiB")  # fmt: skip
        end = tree_rss(server)
        print(f"after {cycles} cycles: {engine_cores(server)} engine cores (acceptance: 0), "
              f"tree RSS {end / 2**20:.0f} MiB")  # fmt: skip
        if rss_at_10:
            print(f"RSS end / cycle 10: {end / rss_at_10:.3f} (acceptance <= 1.05)")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["ttft", "doze", "cycles"], default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=200)
    args = parser.parse_args()
    if args.only in (None, "ttft"):
        bench_ttft(args.rounds)
    if args.only in (None, "doze"):
        bench_doze(args.rounds)
    if args.only in (None, "cycles"):
        bench_cycles(args.cycles)


if __name__ == "__main__":
    main()
