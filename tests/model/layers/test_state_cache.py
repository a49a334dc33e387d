"""The state cache the layers read: slots bound per step, new requests' states zeroed,
padded rows on the scratch slot, a step's states checkpointed and put back."""

from __future__ import annotations

import numpy as np
import torch

from minivllm.model.layers.state_cache import (
    StateCache,
    StateLayer,
    StateShape,
    state_bytes_per_slot,
)
from tests.utils.test_huge_pages import thp_eligible, transparent_huge_pages


class ToyState(StateLayer):
    def state_shapes(self) -> list[StateShape]:
        return [StateShape((3, 2), torch.float32), StateShape((4,), torch.float64)]


def _cache(num_slots: int = 4, max_reqs: int = 6) -> tuple[list[ToyState], StateCache]:
    layers = [ToyState(), ToyState()]
    return layers, StateCache(layers, num_slots, max_reqs, "cpu")


def test_each_layer_gets_num_slots_plus_a_scratch_slot_of_each_shape():
    layers, cache = _cache()
    assert state_bytes_per_slot(layers) == 2 * (3 * 2 * 4 + 4 * 8)
    for layer in layers:
        assert [tuple(s.shape) for s in layer.states] == [(5, 3, 2), (5, 4)]
        assert layer.states[1].dtype == torch.float64
    assert cache.nbytes == 5 * state_bytes_per_slot(layers)


def test_begin_step_zeroes_only_the_requests_that_start_and_pads_with_scratch():
    layers, cache = _cache()
    for layer in layers:
        for state in layer.states:
            state.fill_(7)
    qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    cache.begin_step([2, 0, 3], np.array([False, True, False]), qsl, qsl, 5)
    step = layers[0].step
    assert step.slots.tolist() == [2, 0, 3] and step.num_reqs == 3 and step.max_query_len == 5
    for layer in layers:
        for state in layer.states:
            assert bool((state[0] == 0).all())
            assert bool((state[[1, 2, 3, 4]] == 7).all())
    # A decode step's rows past the batch (CUDA graph padding) point at the scratch slot.
    assert layers[0].decode_slots(5).tolist() == [2, 0, 3, 4, 4]
    # The buffer is rewritten in place: a captured address sees the next step's slots.
    pointer = layers[0].decode_slots(2).data_ptr()
    cache.begin_step([1, 3], np.array([False, False]), qsl[:3], qsl[:3], 1)
    assert layers[0].decode_slots(2).data_ptr() == pointer
    assert layers[0].decode_slots(2).tolist() == [1, 3]


def test_checkpoint_puts_back_the_step_requests_states():
    layers, cache = _cache()
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    cache.begin_step([1, 2], np.array([False, False]), qsl, qsl, 1)
    before = [s.clone() for layer in layers for s in layer.states]
    restore = cache.checkpoint()
    for layer in layers:
        for state in layer.states:
            state[[1, 2]] += 5
    restore()
    after = [s for layer in layers for s in layer.states]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


class BigState(StateLayer):
    def state_shapes(self) -> list[StateShape]:
        return [StateShape((16, 128, 128), torch.float32)]  # 1 MiB: a DeltaNet layer's


def test_host_states_of_huge_page_size_start_on_a_2_mib_boundary_and_read_zero(monkeypatch):
    """States of 2 MiB or more lie in transparent huge pages on the host (a decode step
    streams them): from a 2 MiB boundary, zero, each slot its own; with
    MINIVLLM_CPU_HUGE_PAGES=0 ordinary zeroed pages, the same values."""
    for huge in (True, False):
        monkeypatch.setenv("MINIVLLM_CPU_HUGE_PAGES", "1" if huge else "0")
        layer = BigState()
        StateCache([layer], 3, 4, "cpu")
        (state,) = layer.states
        assert state.shape == (4, 16, 128, 128) and state.is_contiguous()
        assert state.data_ptr() % (2 * 2**20) == 0 or not huge
        if huge and transparent_huge_pages():
            assert thp_eligible(state.data_ptr())
        assert not state.any()
        state[2].fill_(1.5)
        assert state[2].eq(1.5).all() and not state[:2].any() and not state[3].any()
