"""Fixtures for the engine tests: a tiny checkpoint that loads in a blink, process helpers."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from tests.conftest import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_tokenizer) -> str:
    """A random-weight 2-layer Llama: an engine core on it starts in a few seconds."""
    folder = tmp_path_factory.mktemp("tiny-llama-engine")
    return write_tiny_checkpoint("llama", str(folder), smollm2_tokenizer)


@pytest.fixture(scope="session")
def unsupported_arch_model(tmp_path_factory, tiny_llama) -> str:
    """The tiny checkpoint, renamed to an architecture minivllm does not implement."""
    folder = str(tmp_path_factory.mktemp("unsupported-arch") / "model")
    shutil.copytree(tiny_llama, folder)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = ["FooBarForCausalLM"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    return folder


def pid_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return not pid_alive(pid)


def engine_children(parent_pid: int) -> list[int]:
    """Live engine core processes (spawned children) of a process."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if (
            int(fields[1]) == parent_pid
            and fields[0] not in ("Z", "X")
            and b"spawn_main" in cmdline
        ):
            found.append(int(name))
    return found
