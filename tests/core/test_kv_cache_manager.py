"""The KV cache manager: block hashes, cache lookups, allocation and freeing."""

import pytest

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import builtin_hash, extend_block_hashes, sha256_hash
from tests.core.helpers import make_request

BS = 4


def held(kv: KVCacheManager, request) -> list[int]:
    return kv.get_block_ids(request.request_id)


def admit(kv: KVCacheManager, request) -> int:
    """Schedule a waiting request's whole prompt as the scheduler does; its hit length."""
    blocks, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit, blocks, num_hit)
    assert new is not None
    kv.record_prefix_cache_stats(request, num_hit)
    return num_hit


def compute(request, num_tokens: int | None = None) -> None:
    """Pretend the step ran: the scheduled tokens are now computed."""
    request.num_computed_tokens = request.num_tokens if num_tokens is None else num_tokens


@pytest.mark.parametrize("hash_fn", [sha256_hash, builtin_hash])
def test_block_hashes_chain_so_each_names_its_whole_prefix(hash_fn):
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request("b", [9, 2, 3, 4, 5, 6, 7, 8])  # same second block, different first
    extend_block_hashes(a, BS, hash_fn)
    extend_block_hashes(b, BS, hash_fn)
    assert len(a.block_hashes) == 2  # only full blocks are hashed
    assert len(b.block_hashes) == 2
    assert a.block_hashes[1] != b.block_hashes[1]
    a.append_output_token_ids([10, 11, 12])
    extend_block_hashes(a, BS, hash_fn)
    assert len(a.block_hashes) == 3
    assert len(set(a.block_hashes)) == 3


def test_sha256_is_the_default_hash():
    kv = KVCacheManager(8, BS)
    request = make_request("a", [1, 2, 3, 4, 5])
    kv.get_computed_blocks(request)
    assert len(request.block_hashes[0]) == 32


def test_cache_salt_separates_otherwise_equal_prefixes():
    plain = make_request("p", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    salted = make_request("s", [1, 2, 3, 4, 5, 6, 7, 8, 9], cache_salt="tenant-1")
    same_salt = make_request("t", [1, 2, 3, 4, 5, 6, 7, 8, 9], cache_salt="tenant-1")
    for r in (plain, salted, same_salt):
        extend_block_hashes(r, BS, sha256_hash)
    assert not set(plain.block_hashes) & set(salted.block_hashes)
    assert salted.block_hashes == same_salt.block_hashes


def test_longest_cached_prefix_is_found_and_blocks_are_shared():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(1, 11)))  # blocks [1..4] [5..8] and a partial one
    assert admit(kv, a) == 0
    compute(a)
    assert held(kv, a) == [0, 1, 2]
    b = make_request("b", list(range(1, 9)) + [50, 51, 52])
    c = make_request("c", [1, 2, 3, 4, 60, 61, 62, 63, 64])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert ([x.block_id for x in blocks], num_hit) == ([0, 1], 8)
    blocks, num_hit = kv.get_computed_blocks(c)
    assert ([x.block_id for x in blocks], num_hit) == ([0], 4)
    assert admit(kv, b) == 8
    assert held(kv, b) == [0, 1, 3]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.check_invariants()


def test_a_hit_stops_one_token_short_of_the_end():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(1, 9)))  # exactly two blocks
    admit(kv, a)
    compute(a)
    twin = make_request("twin", list(range(1, 9)))
    blocks, num_hit = kv.get_computed_blocks(twin)
    # Both blocks are cached, but the last token must be computed to get logits.
    assert ([x.block_id for x in blocks], num_hit) == ([0], 4)
    longer = make_request("longer", list(range(1, 10)))
    assert kv.get_computed_blocks(longer)[1] == 8


def test_requests_with_prompt_logprobs_do_not_read_the_cache_but_fill_it():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(1, 10)))
    admit(kv, a)
    compute(a)
    wants_logprobs = make_request("lp", list(range(1, 10)), prompt_logprobs=1)
    assert kv.get_computed_blocks(wants_logprobs) == ([], 0)
    kv.free(a)
    assert admit(kv, wants_logprobs) == 0
    compute(wants_logprobs)
    kv.free(wants_logprobs)
    later = make_request("later", list(range(1, 10)))
    assert kv.get_computed_blocks(later)[1] == 8
    assert kv.prefix_cache_queries == 9  # only "a": the prompt-logprobs request is not counted


def test_no_hashes_and_no_hits_with_caching_off():
    kv = KVCacheManager(16, BS, enable_caching=False)
    a = make_request("a", list(range(1, 10)))
    admit(kv, a)
    compute(a)
    b = make_request("b", list(range(1, 10)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert admit(kv, b) == 0
    assert not set(held(kv, a)) & set(held(kv, b))
    assert all(block.block_hash is None for block in kv.block_pool.blocks)
    assert kv.prefix_cache_queries == 0
    kv.check_invariants()


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(1, 10)))
    admit(kv, a)  # 3 blocks
    compute(a)
    b = make_request("b", list(range(20, 28)))  # needs 2
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_num_free_blocks() == 1
    assert held(kv, b) == []
    # A running request that needs one more block gets the last one.
    a.append_output_token_ids([7, 7, 7, 7])
    assert [x.block_id for x in kv.allocate_slots(a, 4)] == [3]
    assert kv.allocate_slots(a, 1) == []  # room left in its last block
    kv.check_invariants()


def test_cache_hits_on_free_blocks_count_against_the_free_blocks():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(1, 9)))
    admit(kv, a)
    compute(a)
    kv.free(a)  # blocks 0 and 1: free but still cached
    other = make_request("other", list(range(30, 38)))
    admit(kv, other)  # takes blocks 2 and 3
    assert kv.get_num_free_blocks() == 2
    b = make_request("b", list(range(1, 9)) + [40, 41, 42, 43, 44])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert ([x.block_id for x in blocks], num_hit) == ([0, 1], 8)
    # Reviving the hits leaves no free block for the two new ones b needs.
    assert kv.allocate_slots(b, 5, blocks, num_hit) is None
    assert kv.get_num_free_blocks() == 2
    assert kv.block_pool.get_cached_block(b.block_hashes[0]).block_id == 0
    kv.check_invariants()


def test_free_releases_tail_first_so_a_chain_is_evicted_from_its_end():
    kv = KVCacheManager(6, BS)
    a = make_request("a", list(range(1, 13)))
    admit(kv, a)
    compute(a)
    assert held(kv, a) == [0, 1, 2]
    kv.free(a)
    assert [b.block_id for b in kv.block_pool.free_block_queue] == [3, 4, 5, 2, 1, 0]
    # Evicting one block drops the end of the chain; the rest of the prefix still hits.
    filler = make_request("filler", list(range(40, 56)))
    admit(kv, filler)
    assert held(kv, filler) == [3, 4, 5, 2]
    again = make_request("again", list(range(1, 13)) + [99])
    assert kv.get_computed_blocks(again)[1] == 8
    kv.check_invariants()


def test_blocks_cached_for_tokens_never_computed_are_forgotten_on_free():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(1, 10)))
    admit(kv, a)  # caches both full blocks at allocation, before the step runs
    assert a.num_computed_tokens == 0
    probe = make_request("probe", list(range(1, 10)) + [77])
    assert kv.get_computed_blocks(probe)[1] == 8  # same-step sharing is allowed
    kv.free(a)  # preempted before the step ran: the KV was never written
    assert kv.get_computed_blocks(probe) == ([], 0)
    kv.check_invariants()

    b = make_request("b", list(range(1, 10)))
    admit(kv, b)
    compute(b, 5)  # the first block and one token of the second were written
    kv.free(b)
    assert kv.get_computed_blocks(probe)[1] == 4
    kv.check_invariants()


def test_prefix_cache_stats_count_tokens_of_admitted_requests():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(1, 11)))
    admit(kv, a)
    compute(a)
    b = make_request("b", list(range(1, 9)) + [50, 51])
    kv.get_computed_blocks(b)  # a lookup alone is not counted
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    admit(kv, b)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)


def test_usage_and_free_blocks():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(1, 10)))
    admit(kv, a)
    assert kv.get_num_free_blocks() == 5
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(a)
    assert kv.usage == 0.0
