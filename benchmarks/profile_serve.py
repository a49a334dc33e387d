"""Where a served request's time goes under a steady rate: samples the frontend (API server)
and the engine core with py-spy while `minivllm bench serve` runs, then prints each
process's busiest frames and the benchmark's latencies.

Starts `minivllm serve` (extra arguments after `--` go to it) on a free port, waits for
/health, records both processes with py-spy (wall-clock samples for the frontend, so an
idle event loop shows as idle; on-CPU samples for the engine core), runs the benchmark
(default: 64 requests, random 128 in / 128 out, 4 requests/s), and stops the server.
With --trace it also timestamps each request's path and each step (serve_trace.py, loaded
through a sitecustomize.py) and prints where TTFT and step time go; --no-py-spy leaves
the sampler out (it costs the engine a little); --vllm-client drives it with vLLM's own
`vllm bench serve` (the acceptance harness). Needs py-spy (`pip install py-spy`) and
ptrace rights (root, or kernel.yama.ptrace_scope=0).

    .venv/bin/python benchmarks/profile_serve.py --request-rate 4 --num-prompts 64
    .venv/bin/python benchmarks/profile_serve.py --out /tmp/prof -- /path/model.gguf
    .venv/bin/python benchmarks/profile_serve.py --trace --no-py-spy -- /path/fp32-dir
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

CLI = [sys.executable, "-m", "minivllm.entrypoints.cli"]
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?):\d+\)$")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("the server exited during start-up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    sys.exit("the server did not become healthy")


def engine_core_pid(server_pid: int) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            return int(entry)
    sys.exit("no engine core process found (is the server running it in-process?)")


def summarize(raw_path: str, title: str, top: int) -> None:
    """Each thread's share of the samples, then the main thread's self and inclusive shares
    per function, from py-spy's raw (collapsed) output."""
    inclusive, own, threads = collections.Counter(), collections.Counter(), collections.Counter()
    total = main_total = 0
    with open(raw_path) as f:
        for line in f:
            stack, count = line.rstrip().rsplit(" ", 1)
            n = int(count)
            total += n
            frames = stack.split(";")
            threads[frames[0]] += n
            if "MainThread" not in frames[0]:
                continue  # the IO threads wait on sockets; the main thread does the work
            main_total += n
            names = []
            for frame in frames[1:]:
                match = FRAME.match(frame)
                names.append(
                    f"{match['func']} [{os.path.basename(match['file'])}]" if match else frame
                )
            if names:
                own[names[-1]] += n
            for name in set(names):
                inclusive[name] += n
    print(f"\n== {title}: {total} samples")
    for thread, n in threads.most_common():
        print(f"{100 * n / total:6.1f}%  {thread}")
    total = max(main_total, 1)
    print("-- main thread, self (where the samples land)")
    for name, n in own.most_common(top):
        print(f"{100 * n / total:6.1f}%  {name}")
    print("-- main thread, inclusive (a frame or anything it calls; plumbing above 95% left out)")
    below = collections.Counter({k: n for k, n in inclusive.items() if n < 0.95 * total})
    for name, n in below.most_common(top * 2):
        print(f"{100 * n / total:6.1f}%  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--sample-rate", type=int, default=100, help="py-spy samples/s")
    parser.add_argument("--top", type=int, default=20, help="frames listed per table")
    parser.add_argument("--out", default=None, help="folder for the raw profiles and results")
    parser.add_argument("--trace", action="store_true", help="timestamp requests and steps")
    parser.add_argument("--no-py-spy", dest="py_spy", action="store_false")
    parser.add_argument(
        "--vllm-client",
        metavar="PEER_VENV",
        help="drive with `vllm bench serve` from this virtualenv (e.g. ~/peer-vllm)",
    )
    parser.add_argument("serve_args", nargs="*", help="after --: arguments of minivllm serve")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if args.py_spy and not os.path.exists(py_spy):
        sys.exit("needs py-spy: pip install py-spy")
    out = args.out or tempfile.mkdtemp(prefix="minivllm-profile-")
    os.makedirs(out, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(out, "server.log"), "w")
    env = dict(os.environ)
    trace = os.path.join(out, "trace")
    if args.trace:
        site = os.path.join(out, "site")
        os.makedirs(site, exist_ok=True)
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(f"import sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n")
            f.write("import serve_trace\nserve_trace.install()\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
        env["MINIVLLM_SERVE_TRACE"] = trace
    server = subprocess.Popen(
        [*CLI, "serve", "--host", "127.0.0.1", "--port", str(port),
         "--disable-uvicorn-access-log", *args.serve_args],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        wait_healthy(url, server)
        core = engine_core_pid(server.pid)
        profiles = {"frontend": os.path.join(out, "frontend.txt")}
        profiles["engine core"] = os.path.join(out, "engine_core.txt")
        if not args.py_spy:
            profiles = {}
        spies = []
        for pid, path, extra in (
            (server.pid, profiles.get("frontend"), ["--idle"]),
            (core, profiles.get("engine core"), []),
        ):
            if not args.py_spy:
                break
            command = [py_spy, "record", "--nonblocking", "--threads", "-f", "raw"]
            command += ["-r", str(args.sample_rate), "-o", path, "-p", str(pid), *extra]
            spies.append(
                subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        time.sleep(1.0)  # let py-spy attach before the first request
        result = os.path.join(out, "bench.json")
        workload = [
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--request-rate", str(args.request_rate),
        ]  # fmt: skip
        if args.vllm_client:  # the acceptance harness: vLLM's own client, its metric names
            model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
            client = [os.path.join(args.vllm_client, "bin", "vllm"), "bench", "serve"]
            client += ["--backend", "openai", "--base-url", url, "--model", model]
            client += ["--dataset-name", "random", "--ignore-eos", "--seed", "0"]
            client += ["--save-result", "--result-dir", out, "--result-filename", "bench.json"]
            subprocess.run([*client, *workload], check=True)
        else:
            subprocess.run([*CLI, "bench", "serve", "--base-url", url, *workload,
                            "--output-json", result], check=True)  # fmt: skip
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
        for spy in spies:
            spy.wait(timeout=60)
        for title, path in profiles.items():
            summarize(path, title, args.top)
        with open(result) as f:
            figures = json.load(f)
        print("\n== bench serve")
        for key, value in figures.items():
            if isinstance(value, (int, float)):
                print(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
        if args.trace:
            sys.path.insert(0, os.path.dirname(__file__))
            import serve_trace

            print("\n== trace\n" + serve_trace.summarize(trace, figures))
        print(f"\nraw profiles and results: {out}")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


if __name__ == "__main__":
    main()
