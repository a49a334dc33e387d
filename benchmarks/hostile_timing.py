"""Issue 47, acceptance 3, timed against a real server on the bundled model: each hostile
case (tests/entrypoints/openai/hostile_cases.py) is refused with a 400 in under 100 ms, or
served while /health stays under 100 ms median (1 s max) and another request's time to
first token stays within 2x of idle; the server exits on SIGTERM within --shutdown-timeout
+ 2 s during each; 25,000 idle sockets leave /health answering.

    python benchmarks/hostile_timing.py                    # every case, then the sockets
    python benchmarks/hostile_timing.py --cases bad_words --idle-sockets 0 --no-sigterm
    # the batch-size cases under other server flags (the server inherits the environment,
    # so MINIVLLM_FAIR_SHARE=0 in front times them without the scheduler's fair shares)
    python benchmarks/hostile_timing.py --cases prompts_x_n,logit_bias --idle-sockets 0 \
        --no-sigterm --server-args="--scheduling-policy slo --default-slo-ttft 0.05"
    # where the scheduler's fair shares bind: 128 sequences of long prompts (not a default
    # case), their KV cache all held; with and without MINIVLLM_FAIR_SHARE (compare the
    # probes' max TTFT: the median mostly samples the shorter steps after the prompts)
    python benchmarks/hostile_timing.py --cases long_prompts_x_n --idle-sockets 0 \
        --no-sigterm --server-args="--no-enable-prefix-caching --kv-cache-memory-bytes 4000000000"

Run it on a quiet machine (nothing else using the cores): it prints a table and one JSON
line per case (`--json FILE` keeps them), with PASS or FAIL per bar. "plain twin" is the
probe's TTFT against idle under the same load with the hostile parameters taken out (the
batch's own cost on this machine: a 128-sequence batch or 32 requests slow every step
whatever they carry); a hostile parameter costs something of its own where "TTFT x idle"
is well above it. The idle sockets are held by child processes, each up to the hard file
limit, so 25,000 need no `ulimit -n` above a usual 20,000; the server raises its soft limit
to its hard one and, past that, closes its longest-idle connection for each new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import signal
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.entrypoints.openai.hostile_cases import (  # noqa: E402
    BY_NAME,
    CASES,
    MODEL,
    SERVER_ARGS,
    HostileCase,
    IdleConnections,
    post,
    start_attack,
)
from tests.entrypoints.openai.utils import RemoteServer  # noqa: E402

# 128 sequences (4 prompts x n=32) of a 412-token prompt: 52,700 prompt tokens without
# prefix caching, some 26 steps of the default budget, which a probe waited for in full
# before the scheduler's fair shares (MINIVLLM_FAIR_SHARE). Not among the cases.
LONG_PROMPT = " ".join(f"item {i} of the list" for i in range(60))
LONG_PROMPTS_X_N = HostileCase(
    "long_prompts_x_n",
    BY_NAME["prompts_x_n"].path,
    refused=BY_NAME["prompts_x_n"].refused,
    served={**BY_NAME["prompts_x_n"].served, "prompt": [f"{k}: {LONG_PROMPT}" for k in range(4)]},
)
ALL_CASES = {**BY_NAME, LONG_PROMPTS_X_N.name: LONG_PROMPTS_X_N}
REFUSED_WITHIN_S = 0.1
HEALTH_MEDIAN_S, HEALTH_MAX_S = 0.1, 1.0
TTFT_RATIO = 2.0
SHUTDOWN_TIMEOUT_S = 1.0
PROBE = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 4, "stream": True}


def health_seconds(server: RemoteServer) -> float:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    started = time.perf_counter()
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
        return time.perf_counter() - started
    except OSError:
        return float("inf")
    finally:
        conn.close()


def ttft(server: RemoteServer) -> float:
    """Seconds from sending a small streamed completion to its first token's event."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
    started = time.perf_counter()
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(PROBE), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        for line in response:
            if line.startswith(b"data: {"):
                return time.perf_counter() - started
        return float("inf")
    finally:
        conn.close()


def refusal(server: RemoteServer, case: HostileCase, repeats: int) -> dict:
    body = json.dumps(case.refused).encode()
    statuses, seconds = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        statuses.append(post(server.url_root, case.path, body))
        seconds.append(time.perf_counter() - started)
    return {
        "refused_statuses": sorted(set(statuses)),
        "refused_median_s": statistics.median(seconds),
        "refused_max_s": max(seconds),
        "refused_ok": set(statuses) == {400} and statistics.median(seconds) < REFUSED_WITHIN_S,
    }


def served_load(server: RemoteServer, case: HostileCase, idle_ttft: float) -> dict:
    """case.concurrent copies of the served request at once; meanwhile /health every 50 ms
    and probe requests one after another, until the copies are answered."""
    body = json.dumps(case.served).encode()
    statuses: list[int] = []
    started = time.perf_counter()

    def send() -> None:
        statuses.append(post(server.url_root, case.path, body, timeout=600))

    senders = [threading.Thread(target=send) for _ in range(case.concurrent)]
    for thread in senders:
        thread.start()
    health: list[float] = []
    probes: list[float] = []
    done = threading.Event()

    def poll_health() -> None:
        while not done.is_set():
            health.append(health_seconds(server))
            time.sleep(0.05)

    poller = threading.Thread(target=poll_health)
    poller.start()
    while any(thread.is_alive() for thread in senders) or not probes:
        probes.append(ttft(server))
    done.set()
    poller.join()
    for thread in senders:
        thread.join()
    ratio = statistics.median(probes) / idle_ttft
    return {
        "served_statuses": sorted(set(statuses)),
        "served_seconds": time.perf_counter() - started,
        "health_median_s": statistics.median(health),
        "health_max_s": max(health),
        "health_samples": len(health),
        "probe_ttft_median_s": statistics.median(probes),
        "probe_ttft_max_s": max(probes),
        "probe_ttft_ratio": ratio,
        "probes": len(probes),
        "served_ok": set(statuses) == {200}
        and statistics.median(health) < HEALTH_MEDIAN_S
        and max(health) < HEALTH_MAX_S
        and ratio <= TTFT_RATIO,
    }


HOSTILE_FIELDS = ("bad_words", "stop", "logit_bias", "response_format", "tools", "tool_choice")


def plain_twin(case: HostileCase) -> HostileCase | None:
    """The case's served load with its hostile parameters taken out (same prompts, n,
    max_tokens and concurrency), or None where nothing is left to take out (prompts x n is
    the load itself). TTFT against idle under the twin is what the machine's batch costs
    anyway; the hostile parameter's own cost is the difference."""
    body = {k: v for k, v in case.served.items() if k not in HOSTILE_FIELDS}
    if body == case.served:
        return None
    if case.path.endswith("chat/completions"):
        body.setdefault("max_tokens", 32)
    return dataclasses.replace(case, served=body)


def sigterm_exit(case: HostileCase | None, idle_sockets: int) -> dict:
    """A fresh server under the case's attack (or idle sockets), SIGTERMed: seconds to exit."""
    server = RemoteServer(
        [
            *SERVER_ARGS,
            "--max-model-len",
            "1024",
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT_S),
            "--max-connections",
            str(max(idle_sockets, 0) + 1024),
        ]
    )
    stop = threading.Event()
    idle = None
    try:
        if case is None:
            idle = IdleConnections(server.host, server.port, idle_sockets)
        else:
            start_attack(server.url_root, case, stop)
        time.sleep(1.5)
        sent = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=120)
        seconds = time.perf_counter() - sent
        return {"sigterm_exit_s": seconds, "sigterm_ok": seconds < SHUTDOWN_TIMEOUT_S + 2}
    finally:
        stop.set()
        if idle is not None:
            idle.close()
        server.kill()


def idle_socket_check(count: int) -> dict:
    server = RemoteServer(
        [*SERVER_ARGS, "--max-model-len", "1024", "--max-connections", str(count + 1024)]
    )
    try:
        idle = IdleConnections(server.host, server.port, count)
        try:
            latencies = sorted(health_seconds(server) for _ in range(20))
        finally:
            idle.close()
        median, worst = statistics.median(latencies), latencies[-1]
        return {
            "case": "idle_sockets",
            "sockets_open": len(idle),
            "health_median_s": median,
            "health_max_s": worst,
            "ok": len(idle) >= count and median < HEALTH_MEDIAN_S and worst < HEALTH_MAX_S,
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--idle-sockets", type=int, default=25_000, help="0: skip the check")
    parser.add_argument("--refusals", type=int, default=5, help="refused requests timed per case")
    parser.add_argument("--idle-probes", type=int, default=9, help="probes for the idle TTFT")
    parser.add_argument("--no-sigterm", action="store_true", help="skip the SIGTERM exits")
    parser.add_argument("--json", help="write the rows, one JSON object a line, here")
    parser.add_argument(
        "--server-args", default="", help="more flags for the timed server (one string)"
    )
    args = parser.parse_args()
    cases = [ALL_CASES[name] for name in args.cases.split(",") if name]

    rows = []
    server = RemoteServer([*SERVER_ARGS, "--max-model-len", "1024", *args.server_args.split()])
    try:
        for _ in range(5):  # warm-up: the first requests pay one-time costs
            ttft(server)
        idle_ttft = statistics.median(ttft(server) for _ in range(args.idle_probes))
        idle_health = statistics.median(health_seconds(server) for _ in range(20))
        print(f"idle: probe TTFT {idle_ttft * 1e3:.1f} ms, /health {idle_health * 1e3:.1f} ms")
        for case in cases:
            row = {"case": case.name, "idle_ttft_s": idle_ttft}
            row |= refusal(server, case, args.refusals)
            row |= served_load(server, case, idle_ttft)
            twin = plain_twin(case)
            if twin is not None:  # the same load without the hostile parameters
                plain = served_load(server, twin, idle_ttft)
                row["plain_twin_ttft_ratio"] = plain["probe_ttft_ratio"]
                row["plain_twin_seconds"] = plain["served_seconds"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.stop()
    if not args.no_sigterm:
        for row, case in zip(rows, cases):
            row |= sigterm_exit(case, 0)
            print(f"{case.name}: SIGTERM exit {row['sigterm_exit_s']:.2f} s", flush=True)
    if args.idle_sockets:
        row = idle_socket_check(args.idle_sockets)
        if not args.no_sigterm:
            row |= sigterm_exit(None, args.idle_sockets)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(
        f"\n{'case':<16} {'refused (ms)':>12} {'/health med/max (ms)':>21} {'TTFT x idle':>11} "
        f"{'plain twin':>10} {'TTFT max (ms)':>13} {'SIGTERM (s)':>11}  verdict"
    )
    for row in rows:
        ok = all(row.get(k, True) for k in ("refused_ok", "served_ok", "sigterm_ok", "ok"))
        refused = f"{row['refused_median_s'] * 1e3:.1f}" if "refused_median_s" in row else "-"
        ratio = f"{row['probe_ttft_ratio']:.2f}" if "probe_ttft_ratio" in row else "-"
        exit_s = f"{row['sigterm_exit_s']:.2f}" if "sigterm_exit_s" in row else "-"
        twin = f"{row['plain_twin_ttft_ratio']:.2f}" if "plain_twin_ttft_ratio" in row else "-"
        health = f"{row['health_median_s'] * 1e3:.1f} / {row['health_max_s'] * 1e3:.1f}"
        worst = f"{row['probe_ttft_max_s'] * 1e3:.0f}" if "probe_ttft_max_s" in row else "-"
        print(
            f"{row['case']:<16} {refused:>12} {health:>21} {ratio:>11} {twin:>10} {worst:>13} "
            f"{exit_s:>11}  "
            f"{'PASS' if ok else 'FAIL'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
