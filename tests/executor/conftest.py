"""Fixtures for the executor tests: a tiny Llama whose heads divide by 2, process helpers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import write_tiny_checkpoint
from tests.engine.conftest import engine_children, pid_alive


@pytest.fixture(scope="session")
def tiny_llama_tp(tmp_path_factory, smollm2_tokenizer) -> str:
    """A random-weight 2-layer Llama with 4 heads and 2 KV heads: splits into 2 ranks."""
    folder = tmp_path_factory.mktemp("tiny-llama-tp")
    return write_tiny_checkpoint("llama", str(folder), smollm2_tokenizer)


def worker_pids(engine_pid: int, expected: int) -> list[int]:
    """The worker processes the engine core process spawned."""
    pids = engine_children(engine_pid)
    assert len(pids) == expected, pids
    return pids


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def processes_named(prefix: bytes) -> list[int]:
    """Live processes whose command line starts with prefix (Ray names its actors so)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if cmdline.startswith(prefix) and pid_alive(int(name)):
            found.append(int(name))
    return found


@contextlib.contextmanager
def two_ray_nodes(home, num_cpus: int, second_node_resources: dict | None = None):
    """A Ray cluster of two nodes on 127.0.0.1 (`ray start --head`, then `ray start
    --address` with ``second_node_resources`` as custom resources), ``num_cpus`` each;
    yields the environment of a driver that joins it (RAY_ADDRESS), and stops both nodes.
    HOME is ``home``, a fresh folder: a token in ~/.ray would turn on Ray's token
    authentication."""
    from minivllm.distributed.parallel_state import get_open_port

    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths are long
    port = get_open_port("127.0.0.1")
    # Not this process's Ray settings (the module's cluster set some, e.g. its auth mode);
    # the CLI's nodes may be multi-node (their switch on).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    start = [ray_cli, "start", "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus),
             "--disable-usage-stats"]  # fmt: skip
    second = ["--address", f"127.0.0.1:{port}"]
    if second_node_resources:
        second += ["--resources", json.dumps(second_node_resources)]
    try:
        for args in (["--head", "--port", str(port), "--include-dashboard", "false",
                      "--temp-dir", temp_dir], second):  # fmt: skip
            done = subprocess.run([*start, *args], env=env, capture_output=True, text=True,
                                  timeout=120)  # fmt: skip
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    finally:
        for pid in processes_started_under(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def processes_started_under(temp_dir: str) -> list[int]:
    """The Ray processes (head and node) whose command line names the cluster's folder."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if temp_dir.encode() in f.read():
                        found.append(int(name))
            except OSError:
                continue
    return found
