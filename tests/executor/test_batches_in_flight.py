"""How many steps an executor lets the batch queue keep in flight: one per pipeline stage
and MINIVLLM_PP_EXTRA_BATCHES more, one with the queue off or without stages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minivllm.executor.abstract import Executor


def executor(pp: int) -> Executor:
    return Executor(SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=pp)))


@pytest.mark.parametrize(
    ("pp", "env", "expected"),
    [
        (2, {}, 2),  # the default: one a stage, as vLLM's
        (4, {}, 4),
        (2, {"MINIVLLM_PP_EXTRA_BATCHES": "1"}, 3),
        (2, {"MINIVLLM_PP_EXTRA_BATCHES": "2"}, 4),
        (2, {"MINIVLLM_PP_BATCH_QUEUE": "0"}, 1),  # one batch at a time, to compare
        (1, {}, 1),  # no stages: nothing to overlap
    ],
)
def test_batches_in_flight(monkeypatch, pp, env, expected):
    monkeypatch.delenv("MINIVLLM_PP_EXTRA_BATCHES", raising=False)
    monkeypatch.delenv("MINIVLLM_PP_BATCH_QUEUE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert executor(pp).max_concurrent_batches == expected


def test_a_negative_extra_is_refused(monkeypatch):
    monkeypatch.setenv("MINIVLLM_PP_EXTRA_BATCHES", "-1")
    with pytest.raises(ValueError, match="MINIVLLM_PP_EXTRA_BATCHES"):
        _ = executor(2).max_concurrent_batches
