"""The GPU's KV cache: gpu_memory_utilization of the card, less what a profiling pass
measures (vLLM V1's rule), checked with numbers and with torch.cuda's reports faked."""

from __future__ import annotations

import logging

import pytest
import torch

from minivllm.config import CacheConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.create_config import create_cache_config
from minivllm.platforms.cuda import CudaPlatform, kv_cache_budget

GiB = 1 << 30


def test_the_budget_is_the_allowed_share_less_weights_activations_and_non_torch():
    budget = kv_cache_budget(
        total=80 * GiB,
        utilization=0.9,
        weights=16 * GiB,
        peak_activations=4 * GiB,
        non_torch=GiB,
        min_bytes=GiB,
    )
    assert budget == int(80 * GiB * 0.9) - 21 * GiB


@pytest.mark.parametrize("min_bytes", [1, 2 * GiB])
def test_no_room_for_the_kv_cache_is_refused_with_what_to_change(min_bytes):
    with pytest.raises(ValueError, match="leaves nothing for the KV cache") as info:
        kv_cache_budget(8 * GiB, 0.5, 3 * GiB, GiB, GiB // 2, min_bytes)
    assert "Raise gpu_memory_utilization, or lower max_num_seqs" in str(info.value)


def test_a_budget_below_one_max_model_len_request_is_refused():
    # 8 GiB allowed - 5 - 1: 2 GiB left.
    assert kv_cache_budget(10 * GiB, 0.8, 5 * GiB, GiB, 0, min_bytes=2 * GiB) == 2 * GiB
    with pytest.raises(
        ValueError, match=r"leaves 2.00 GiB for the KV cache, less than .* \(2.250 GiB\)"
    ) as info:
        kv_cache_budget(10 * GiB, 0.8, 5 * GiB, GiB, 0, min_bytes=9 * GiB // 4)
    assert "or lower max_model_len, or lower max_num_seqs" in str(info.value)


class FakeCard:
    """torch.cuda's reports on an 80 GiB card: 16 GiB of weights; the profiling pass peaks
    6 GiB above them, 1 GiB of it its temporary KV cache; the driver holds 1 GiB outside
    torch, and torch keeps 1 GiB cached after empty_cache."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.peak = 0

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset")
        self.peak = self.memory_allocated()

    def profile_run(self) -> int:
        self.calls.append("profile")
        self.peak = 22 * GiB
        return GiB

    def memory_allocated(self) -> int:
        return 16 * GiB

    def max_memory_allocated(self) -> int:
        return self.peak

    def memory_reserved(self) -> int:
        return 17 * GiB

    def mem_get_info(self) -> tuple[int, int]:
        return 80 * GiB - 17 * GiB - GiB, 80 * GiB

    def empty_cache(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_the_measurements_feed_the_budget(monkeypatch, caplog):
    card = FakeCard()
    for name in (
        "reset_peak_memory_stats",
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "mem_get_info",
        "empty_cache",
        "synchronize",
    ):
        monkeypatch.setattr(torch.cuda, name, getattr(card, name))
    config = create_cache_config(EngineArgs(gpu_memory_utilization=0.9), CudaPlatform())
    assert config.gpu_memory_utilization == 0.9 and config.kv_cache_memory_bytes is None
    with caplog.at_level(logging.INFO, logger="minivllm.platforms.cuda"):
        budget = CudaPlatform().available_kv_cache_memory(config, card.profile_run, GiB)
    # 72 GiB allowed - 16 weights - 5 activations (the temporary cache is free again) - 1.
    assert budget == int(80 * GiB * 0.9) - 22 * GiB
    assert card.calls == ["reset", "profile"]
    assert "weights 16.00 GiB, peak activations 5.00 GiB, non-torch 1.00 GiB" in caplog.text


def test_a_given_size_overrides_the_utilization():
    config = CacheConfig(kv_cache_memory_bytes=GiB, gpu_memory_utilization=0.1)

    def no_profiling() -> int:
        raise AssertionError("kv_cache_memory_bytes given: nothing to measure")

    assert CudaPlatform().available_kv_cache_memory(config, no_profiling, 1) == GiB
