"""Fixtures for the executor tests: a tiny Llama whose heads divide by 2, process helpers."""

from __future__ import annotations

import os

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
