"""The state cache beside the KV blocks: slots in the manager and the scheduler, and how one
budget splits between them (a hybrid request's cache does not grow with its state)."""

import logging

import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import KVCacheSpec
from minivllm.core.scheduler import Scheduler
from tests.core.helpers import make_request, step

BS = 4


def test_a_request_holds_one_slot_while_it_runs():
    kv = KVCacheManager(16, BS, enable_caching=False, num_state_slots=2)
    a, b, c = (make_request(n, [1, 2, 3, 4, 5]) for n in "abc")
    assert kv.allocate_slots(a, 5) is not None
    slot_a = kv.get_state_slot("a")
    assert kv.allocate_slots(a, 1) is not None  # more tokens: the same slot
    assert kv.get_state_slot("a") == slot_a
    assert kv.allocate_slots(b, 5) is not None
    assert {kv.get_state_slot("a"), kv.get_state_slot("b")} == {0, 1}
    kv.check_invariants()
    free_blocks = kv.get_num_free_blocks()
    assert kv.allocate_slots(c, 5) is None  # blocks are free, but no slot
    assert kv.get_num_free_blocks() == free_blocks and kv.get_state_slot("c") is None
    kv.free(a)  # finished or preempted: its state goes with its blocks
    assert kv.get_state_slot("a") is None
    assert kv.allocate_slots(c, 5) is not None
    assert kv.get_state_slot("c") == slot_a
    kv.check_invariants()
    kv.free(b)
    kv.free(c)
    kv.check_invariants()
    assert kv.state_pool.get_num_free_slots() == 2


def test_no_blocks_no_slot_taken():
    kv = KVCacheManager(2, BS, enable_caching=False, num_state_slots=2)
    assert kv.allocate_slots(make_request("a", list(range(20))), 20) is None
    assert kv.state_pool.get_num_free_slots() == 2
    kv.check_invariants()


def test_prefix_caching_is_switched_off_with_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="minivllm.core.kv_cache_manager"):
        kv = KVCacheManager(16, BS, enable_caching=True, num_state_slots=2)
    assert not kv.enable_caching
    assert sum("Prefix caching is off" in r.message for r in caplog.records) == 1
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.free(first)
    again = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(again) == ([], 0)  # never a prefix without its state
    plain = KVCacheManager(16, BS, enable_caching=True)
    assert plain.enable_caching


def _scheduler(num_state_slots: int, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, 64, 256),
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        num_blocks,
        num_state_slots=num_state_slots,
    )


def test_scheduler_runs_no_more_requests_than_slots_and_sends_each_its_slot():
    sched = _scheduler(num_state_slots=2)
    for name in "abc":
        sched.add_request(make_request(name, [1, 2, 3], max_tokens=3))
    so, _ = step(sched)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a", "b"]
    assert sorted(n.state_slot for n in so.scheduled_new_reqs) == [0, 1]
    sched.check_invariants()
    seen = {}
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        for new in so.scheduled_new_reqs:
            seen[new.req_id] = new.state_slot
        sched.check_invariants()
        assert len(sched.kv_cache_manager.state_pool.req_to_slot) <= 2
    assert seen["c"] in (0, 1)
    assert sched.kv_cache_manager.state_pool.get_num_free_slots() == 2


def test_preemption_frees_the_state_and_the_request_restarts_from_zero():
    # 6 blocks of 4: two requests growing to 16 tokens each cannot both fit.
    sched = _scheduler(num_state_slots=4, num_blocks=6)
    sched.add_request(make_request("a", [1] * 8, max_tokens=8))
    sched.add_request(make_request("b", [2] * 8, max_tokens=8))
    preempted = False
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        sched.check_invariants()
        for req_id in so.preempted_req_ids:
            preempted = True
            assert sched.kv_cache_manager.get_state_slot(req_id) is None
            assert sched.requests[req_id].num_computed_tokens == 0
        for new in so.scheduled_new_reqs:
            assert new.num_computed_tokens == 0 and new.state_slot is not None
    assert preempted
    assert sched.kv_cache_manager.state_pool.get_num_free_slots() == 4


def test_a_model_without_state_has_no_slots():
    sched = _scheduler(num_state_slots=0)
    sched.add_request(make_request("a", [1, 2, 3]))
    so, _ = step(sched)
    assert so.scheduled_new_reqs[0].state_slot is None
    assert sched.kv_cache_manager.enable_caching


def test_budget_gives_state_slots_first_up_to_max_num_seqs():
    spec = KVCacheSpec(block_size=16, bytes_per_block=1000, bytes_per_state_slot=5000)
    # Plenty: max_num_seqs slots, the rest blocks.
    assert spec.split_budget(1_000_000, 8, 256) == ((1_000_000 - 8 * 5000) // 1000, 8)
    # Large states: at most half the budget.
    big = KVCacheSpec(block_size=16, bytes_per_block=1000, bytes_per_state_slot=100_000)
    assert big.split_budget(1_000_000, 256, 256) == (500, 5)
    # Tight: the blocks of one max_model_len request first, then what slots fit.
    assert spec.split_budget(16 * 1000 + 2 * 5000 + 999, 8, 256) == (16, 2)
    assert spec.split_budget(16 * 1000 + 4999, 8, 256)[1] == 0
    plain = KVCacheSpec(block_size=16, bytes_per_block=1000)
    assert plain.split_budget(1_000_000, 8, 256) == (1000, 0)


def _layer_kv_bytes(num_kv_heads: int, head_dim: int, block_size: int, elem: int) -> int:
    return 2 * num_kv_heads * head_dim * block_size * elem


@pytest.mark.parametrize("elem", [2, 4])  # bfloat16 (GPU) and float32 (CPU) caches
def test_a_4k_hybrid_request_costs_under_a_third_of_a_llama_of_its_shape(elem):
    """Acceptance 3, on Granite 4.0-H Tiny's shape: 40 layers of width 1536, 4 of them
    attention (4 KV heads of 128); 36 Mamba-2 layers with a [3328, 3] conv state and a
    [48, 64, 128] float32 SSM state. A Llama of the same width and layer count attends in
    all 40 (the same KV heads)."""
    bs = 16
    per_layer = _layer_kv_bytes(4, 128, bs, elem)
    mamba_state = 3328 * 3 * elem + 48 * 64 * 128 * 4
    llama = KVCacheSpec(bs, 40 * per_layer)
    granite = KVCacheSpec(bs, 4 * per_layer, 36 * mamba_state)
    assert granite.request_bytes(4096) < llama.request_bytes(4096) / 3
    # The state does not grow: only the attention layers' blocks do.
    growth = granite.request_bytes(4096) - granite.request_bytes(128)
    assert growth == (4096 - 128) // bs * 4 * per_layer
