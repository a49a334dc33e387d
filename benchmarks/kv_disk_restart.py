"""The persistent prefix cache across a restart (issue #53, acceptance 4): start
`minivllm serve --kv-cache-disk DIR`, ask about a ~4,000-token document (streamed, greedy),
stop the server, start it again, ask the same: the second time to first token should be
<= 0.2x the first, the answer the same tokens, and /metrics should show the disk hits
(vllm:external_prefix_cache_hits_total). Each pair uses a fresh DIR.

    .venv/bin/python benchmarks/kv_disk_restart.py --pairs 3
    .venv/bin/python benchmarks/kv_disk_restart.py --pairs 1 --kv-cache-dtype int8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from compare_serve import stop_server, wait_healthy  # noqa: E402
from gguf_perplexity import fixed_text  # noqa: E402

PORT = 8125


def start(disk: str, kv_cache_dtype: str, model: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve"]
    cmd += [model] if model else []
    cmd += ["--kv-cache-disk", disk, "--kv-cache-dtype", kv_cache_dtype]
    cmd += ["--host", "127.0.0.1", "--port", str(PORT), "--max-model-len", "8192"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    return wait_healthy(proc, PORT, 600, "minivllm")


def ask(document: str) -> tuple[float, list[str]]:
    """(time to first token, the streamed pieces) of one greedy completion."""
    body = json.dumps(
        {
            "prompt": document + "\n\nQuestion: what is this document about? Answer:",
            "max_tokens": 32,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/completions",
        body,
        {"Content-Type": "application/json"},
    )
    start, first, pieces = time.perf_counter(), None, []
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            text = json.loads(line[5:])["choices"][0]["text"]
            if first is None and text:
                first = time.perf_counter()
            pieces.append(text)
    return first - start, pieces


def disk_hits() -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:external_prefix_cache_hits_total"):
                return float(line.split()[-1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--doc-chars", type=int, default=16000, help="~4,000 tokens")
    args = parser.parse_args()
    document = fixed_text()[: args.doc_chars]
    rows = []
    for _ in range(args.pairs):
        with tempfile.TemporaryDirectory() as disk:
            proc = start(disk, args.kv_cache_dtype, args.model)
            cold, first_answer = ask(document)
            stop_server(proc)  # its queued blocks reach the disk before it exits
            proc = start(disk, args.kv_cache_dtype, args.model)
            warm, second_answer = ask(document)
            hits = disk_hits()
            stop_server(proc)
        rows.append({"cold_ttft_s": cold, "warm_ttft_s": warm, "ratio": warm / cold})
        rows[-1] |= {"same_answer": first_answer == second_answer, "disk_hit_tokens": hits}
        print(json.dumps(rows[-1]))
    print("median warm/cold TTFT:", statistics.median(r["ratio"] for r in rows))


if __name__ == "__main__":
    main()
