"""Prefix caching through the scheduler: exact block ids, sharing, eviction, stats."""

import pytest

from minivllm.engine.messages import FinishReason
from tests.core.helpers import FakeEngine, make_request, make_scheduler, token_at

BS = 4


def engine(**kwargs) -> FakeEngine:
    return FakeEngine(make_scheduler(block_size=BS, **kwargs))


def ref_cnts(eng, block_ids):
    return [eng.sched.kv_cache_manager.block_pool.blocks[i].ref_cnt for i in block_ids]


def free_queue(eng) -> list[int]:
    return [b.block_id for b in eng.sched.kv_cache_manager.block_pool.free_block_queue]


def new_req(so, req_id):
    (new,) = [n for n in so.scheduled_new_reqs if n.req_id == req_id]
    return new


def done(req_id, prompt_len, max_tokens):
    """What a request that ran to max_tokens must have produced."""
    return [token_at(req_id, prompt_len + i) for i in range(max_tokens)], FinishReason.LENGTH


@pytest.mark.usefixtures("mixed_steps")
def test_hit_while_the_owner_runs_shares_its_blocks():
    eng = engine(num_blocks=16)
    eng.add(make_request("A", list(range(1, 11)), max_tokens=6))
    so = eng.step()
    assert new_req(so, "A").block_ids == [0, 1, 2]

    eng.add(make_request("B", list(range(1, 9)) + [50, 51, 52], max_tokens=4))
    so = eng.step()
    b = new_req(so, "B")
    assert b.block_ids == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"A": 1, "B": 3}
    assert ref_cnts(eng, [0, 1, 2, 3]) == [2, 2, 1, 1]
    stats = eng.sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)

    eng.run()
    assert eng.result("A") == done("A", 10, 6)
    assert eng.result("B") == done("B", 11, 4)
    assert eng.sched.kv_cache_manager.get_num_free_blocks() == 16


def test_hit_after_the_owner_finished_revives_its_freed_blocks():
    eng = engine(num_blocks=16)
    eng.add(make_request("A", list(range(1, 11)), max_tokens=1))
    eng.step()
    assert eng.result("A") == done("A", 10, 1)
    # Freed tail first: the chain's end is the first of A's blocks to be evicted.
    assert free_queue(eng) == list(range(3, 16)) + [2, 1, 0]

    eng.add(make_request("C", list(range(1, 9)) + [60, 61], max_tokens=2))
    so = eng.step()
    c = new_req(so, "C")
    assert c.block_ids == [0, 1, 3]
    assert c.num_computed_tokens == 8
    assert ref_cnts(eng, [0, 1]) == [1, 1]
    assert free_queue(eng) == list(range(4, 16)) + [2]
    eng.run()
    assert eng.result("C") == done("C", 10, 2)


def test_two_requests_admitted_in_one_step_share_the_prefix():
    eng = engine(num_blocks=16)
    eng.add(make_request("A", list(range(1, 11)), max_tokens=3))
    eng.add(make_request("B", list(range(1, 9)) + [70, 71, 72], max_tokens=3))
    so = eng.step()  # B reads KV that A writes in this very step
    assert so.num_scheduled_tokens == {"A": 10, "B": 3}
    assert new_req(so, "B").block_ids[:2] == new_req(so, "A").block_ids[:2] == [0, 1]
    eng.run()
    assert eng.result("A") == done("A", 10, 3)
    assert eng.result("B") == done("B", 11, 3)


def test_exact_eviction_order_after_frees_and_hash_reset_on_eviction():
    eng = engine(num_blocks=6)
    a = make_request("A", list(range(1, 13)), max_tokens=1)
    eng.add(a)
    eng.step()  # A: blocks 0, 1, 2, then finished
    assert free_queue(eng) == [3, 4, 5, 2, 1, 0]
    eng.add(make_request("B", list(range(20, 28)), max_tokens=1))
    so = eng.step()
    assert new_req(so, "B").block_ids == [3, 4]
    assert free_queue(eng) == [5, 2, 1, 0, 4, 3]

    pool = eng.sched.kv_cache_manager.block_pool
    eng.add(make_request("D", list(range(40, 52)), max_tokens=1))
    so = eng.step()
    assert new_req(so, "D").block_ids == [5, 2, 1]
    # Blocks 2 and 1 were evicted: A's hashes for them are gone; block 0 keeps its own.
    assert pool.get_cached_block(a.block_hashes[2]) is None
    assert pool.get_cached_block(a.block_hashes[1]) is None
    assert pool.get_cached_block(a.block_hashes[0]).block_id == 0
    assert pool.blocks[2].block_hash not in a.block_hashes
    eng.add(make_request("E", list(range(1, 13)) + [90], max_tokens=1))
    so = eng.step()
    assert new_req(so, "E").num_computed_tokens == 4
    assert new_req(so, "E").block_ids[0] == 0


def test_full_hit_recomputes_the_last_block_when_the_prompt_fills_whole_blocks():
    eng = engine(num_blocks=16)
    eng.add(make_request("A", list(range(1, 9)), max_tokens=1))
    eng.step()
    eng.add(make_request("B", list(range(1, 9)), max_tokens=3))
    so = eng.step()
    b = new_req(so, "B")
    # All 8 tokens are cached, but the last must be computed for its logits: the whole
    # last block is recomputed, into a fresh block (2, the head of the free queue).
    assert b.num_computed_tokens == 4
    assert so.num_scheduled_tokens == {"B": 4}
    assert b.block_ids == [0, 2]
    eng.run()
    assert eng.result("B") == done("B", 8, 3)


def test_cache_salt_keeps_requests_apart():
    eng = engine(num_blocks=32)
    prompt = list(range(1, 11))
    eng.add(make_request("A", prompt, max_tokens=1, cache_salt="alice"))
    eng.step()
    eng.add(make_request("B", prompt, max_tokens=1, cache_salt="bob"))
    eng.add(make_request("C", prompt, max_tokens=1))
    eng.add(make_request("D", prompt, max_tokens=1, cache_salt="alice"))
    so = eng.step()
    computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    assert computed == {"B": 0, "C": 0, "D": 8}


def test_requests_with_prompt_logprobs_compute_every_prompt_token():
    eng = engine(num_blocks=32)
    eng.add(make_request("A", list(range(1, 11)), max_tokens=1))
    eng.step()
    eng.add(make_request("B", list(range(1, 11)), max_tokens=1, prompt_logprobs=0))
    so = eng.step()
    assert new_req(so, "B").num_computed_tokens == 0
    assert so.num_scheduled_tokens == {"B": 10}


def test_with_caching_off_nothing_is_shared_or_counted():
    eng = engine(num_blocks=16, enable_prefix_caching=False)
    eng.add(make_request("A", list(range(1, 11)), max_tokens=4))
    eng.step()
    eng.add(make_request("B", list(range(1, 11)), max_tokens=4))
    so = eng.step()
    b = new_req(so, "B")
    assert b.num_computed_tokens == 0
    assert b.block_ids == [3, 4, 5]
    assert ref_cnts(eng, [0, 1, 2]) == [1, 1, 1]
    stats = eng.sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    eng.run()
    assert eng.result("B") == done("B", 10, 4)
    assert eng.sched.kv_cache_manager.get_num_free_blocks() == 16


@pytest.mark.usefixtures("mixed_steps")
def test_stats_count_each_admission_once_not_each_refused_lookup():
    eng = engine(num_blocks=4)
    eng.add(make_request("A", list(range(1, 13)), max_tokens=4))  # 3 blocks, then all 4
    eng.step()
    eng.add(make_request("B", list(range(1, 9)) + [5], max_tokens=1))
    for _ in range(3):  # B needs one new block, but A takes the last: B waits A out
        so = eng.step()
        assert "B" not in so.num_scheduled_tokens
        if "A" in eng.sched.requests:
            stats = eng.sched.make_stats()
            assert (stats.kv_cache_usage, stats.num_free_blocks) == (1.0, 0)
    assert eng.result("A") == done("A", 12, 4)
    stats = eng.sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12, 0)
    eng.run()
    stats = eng.sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12 + 9, 8)
    assert stats.kv_cache_usage == 0.0
    assert eng.result("B") == done("B", 9, 1)


def test_the_builtin_hash_works_the_same_way():
    eng = engine(num_blocks=16, hash_algo="builtin")
    eng.add(make_request("A", list(range(1, 11)), max_tokens=2))
    eng.add(make_request("B", list(range(1, 11)) + [3], max_tokens=2))
    so = eng.step()
    assert new_req(so, "B").num_computed_tokens == 8
    eng.run()
    assert eng.result("B") == done("B", 11, 2)
