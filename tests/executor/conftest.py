"""Fixtures for the executor tests: a tiny Llama whose heads divide by 2, process helpers."""

from __future__ import annotations

import pytest

from tests.conftest import write_tiny_checkpoint
from tests.engine.conftest import engine_children


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
