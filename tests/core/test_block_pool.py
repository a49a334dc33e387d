"""The block pool: the intrusive free queue, lazy eviction of hashes, and its invariants."""

import pytest

from minivllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_pops_from_head_appends_at_tail_and_unlinks_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])
    queue.append(blocks[0])
    assert ids(queue) == [1, 3, 4, 0]
    assert queue.num_free_blocks == 4
    queue.remove(blocks[0])  # the tail
    queue.remove(blocks[1])  # the head
    assert ids(queue) == [3, 4]
    assert queue.popleft() is blocks[3]
    assert queue.popleft() is blocks[4]
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError):
        queue.popleft()


def test_free_queue_refuses_to_unlink_a_block_it_does_not_hold_or_to_hold_one_twice():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    taken = queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(taken)
    with pytest.raises(RuntimeError):
        queue.append(blocks[1])
    assert ids(queue) == [1, 2]


def test_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(6, enable_caching=True)
    got = pool.get_new_blocks(2)
    assert ids(got) == [0, 1]
    assert [b.ref_cnt for b in got] == [1, 1]
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == pytest.approx(2 / 6)
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    assert pool.get_num_free_blocks() == 4  # a refused request takes nothing
    pool.check_invariants({0: 1, 1: 1})


def test_free_order_is_eviction_order():
    pool = BlockPool(4, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c, a])
    pool.free_blocks([d, b])
    assert ids(pool.free_block_queue) == [2, 0, 3, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 0, 3]
    pool.check_invariants({1: 0, 2: 1, 0: 1, 3: 1})


def test_a_freed_block_keeps_its_hash_until_it_is_handed_out_again():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"])
    pool.free_blocks([b, a])
    assert pool.get_num_free_blocks() == 3
    assert pool.get_cached_block(b"ha") is a and a.block_hash == b"ha"
    assert pool.get_cached_block(b"hb") is b
    pool.check_invariants()
    # The never-used block 2 goes first, then b (freed first), then a.
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    assert pool.get_cached_block(b"hb") is None
    assert b.block_hash is None  # reset when evicted
    assert pool.get_cached_block(b"ha") is a  # not evicted yet
    pool.check_invariants({1: 1, 2: 1})


def test_touch_revives_a_free_cached_block_and_shares_a_used_one():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"])
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 3
    pool.touch([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 2)
    assert pool.get_num_free_blocks() == 2
    assert ids(pool.free_block_queue) == [2, 3]
    pool.check_invariants({0: 1, 1: 2})


def test_cache_full_blocks_keeps_the_first_block_of_a_content():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h"])
    pool.cache_full_blocks([b], [b"h"])
    assert pool.get_cached_block(b"h") is a
    assert b.block_hash is None
    pool.cache_full_blocks([a], [b"other"])  # already cached: a keeps its hash
    assert a.block_hash == b"h" and pool.get_cached_block(b"other") is None
    pool.check_invariants({0: 1, 1: 1})


def test_evict_cached_block_forgets_the_hash_at_once():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"h"])
    pool.free_blocks([a])
    pool.evict_cached_block(a)
    assert pool.get_cached_block(b"h") is None and a.block_hash is None
    pool.check_invariants()


def test_a_double_free_raises():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError):
        pool.free_blocks([a])
    pool.check_invariants()


def test_reset_prefix_cache_only_when_no_block_is_in_use():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"])
    pool.free_blocks([a])
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(b"ha") is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"ha") is None and pool.get_cached_block(b"hb") is None
    assert a.block_hash is None
    pool.check_invariants()


def test_check_invariants_catches_a_wrong_ref_count():
    pool = BlockPool(3, enable_caching=True)
    pool.get_new_blocks(2)
    pool.check_invariants({0: 1, 1: 1})
    with pytest.raises(AssertionError):
        pool.check_invariants({0: 2, 1: 1})  # a holder the pool does not know about
    with pytest.raises(AssertionError):
        pool.check_invariants({0: 1})  # block 1 held by nobody but not free


def test_check_invariants_catches_a_free_block_with_references_and_a_stale_hash():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.blocks[2].ref_cnt = 1  # in the free queue, yet referenced
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool.blocks[2].ref_cnt = 0
    pool.cached_block_hash_to_block[b"ghost"] = a  # maps to a block without that hash
    with pytest.raises(AssertionError):
        pool.check_invariants()
