"""Which layers each pipeline stage holds: an even split with the remainder before the
last stage, or VLLM_PP_LAYER_PARTITION's counts."""

from __future__ import annotations

import pytest

from minivllm.distributed.parallel_state import PPGroup, stage_layer_counts


@pytest.fixture(autouse=True)
def no_partition(monkeypatch):
    monkeypatch.delenv("MINIVLLM_PP_LAYER_PARTITION", raising=False)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    return monkeypatch


def test_even_split_gives_the_remainder_to_the_stages_before_the_last():
    assert stage_layer_counts(24, 2) == [12, 12]
    assert stage_layer_counts(30, 4) == [7, 8, 8, 7]
    assert stage_layer_counts(7, 3) == [2, 3, 2]
    assert stage_layer_counts(5, 1) == [5]
    ranges = [PPGroup(rank=r, size=4).layer_range(30) for r in range(4)]
    assert ranges == [(0, 7), (7, 15), (15, 23), (23, 30)]


def test_vllm_pp_layer_partition_sets_the_stages(no_partition):
    no_partition.setenv("VLLM_PP_LAYER_PARTITION", "10,14")
    assert stage_layer_counts(24, 2) == [10, 14]
    assert PPGroup(rank=1, size=2).layer_range(24) == (10, 24)
    assert stage_layer_counts(24, 1) == [24]  # one stage holds them all whatever it says
    for bad in ("10,13", "24,0", "8,8,8", "ten,14"):
        no_partition.setenv("VLLM_PP_LAYER_PARTITION", bad)
        with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION"):
            stage_layer_counts(24, 2)
