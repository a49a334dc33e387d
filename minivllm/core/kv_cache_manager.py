"""Which blocks (and, for a hybrid model, which state slot) each request holds: prefix-cache
lookups, allocation and freeing."""

from __future__ import annotations

import logging
from collections import Counter

from minivllm.core.block_pool import BlockPool, KVCacheBlock
from minivllm.core.kv_cache_utils import HASH_FUNCTIONS, extend_block_hashes
from minivllm.core.request import Request
from minivllm.core.state_pool import StatePool
from minivllm.kv_offload.disk_tier import DiskTier, KVTransfers

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        num_state_slots: int = 0,
        disk: DiskTier | None = None,
    ) -> None:
        """num_state_slots: the state cache's slots, for a model with state layers (0: none).
        Such a model's cached prefix would need its state at the prefix's end too, which
        is not kept: prefix caching is off for it."""
        self.block_size = block_size
        self.state_pool = StatePool(num_state_slots) if num_state_slots else None
        if enable_caching and self.state_pool is not None:
            logger.info(
                "Prefix caching is off: this model's state layers keep a per-request state "
                "that a cached prefix would not restore."
            )
            enable_caching = False
        self.enable_caching = enable_caching
        self.hash_fn = HASH_FUNCTIONS[hash_algo]
        # disk: the persistent prefix cache under the block pool (--kv-cache-disk).
        self.block_pool = BlockPool(num_blocks, enable_caching, disk)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the hash map.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # in tokens
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def reads_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs need every prompt position computed, so such requests never hit.
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request: (blocks, number of tokens).

        It takes no reference: pass the blocks to allocate_slots in the same step.
        """
        if not self.reads_prefix_cache(request):
            return [], 0
        self._update_hashes(request)
        # Cap at num_tokens - 1: the last token is always computed, to produce logits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_stats(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a request refused for room is not counted)."""
        if self.reads_prefix_cache(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens; the new blocks, or None if they don't fit.

        new_computed_blocks are prefix-cache hits for a request being scheduled from waiting.
        A hybrid model's request also takes a state slot the first time (None if none is
        free); it keeps it until freed.
        """
        state_pool = self.state_pool
        if not new_computed_blocks and not num_new_computed_tokens and state_pool is None:
            # The common decode step: the request's blocks already hold its new tokens.
            held = self.req_to_blocks.get(request.request_id)
            total_tokens = request.num_computed_tokens + num_new_tokens
            if held is not None and total_tokens <= len(held) * self.block_size:
                if (
                    self.enable_caching
                    and total_tokens // self.block_size
                    > self.num_cached_blocks.get(request.request_id, 0)
                ):
                    self._cache_full_blocks(request, total_tokens)  # a block just filled
                return []
        new_computed_blocks = new_computed_blocks or []
        if state_pool is not None and not state_pool.can_allocate(request.request_id):
            return None
        held = self.req_to_blocks.setdefault(request.request_id, [])
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = cdiv(total_tokens, self.block_size) - len(held) - len(new_computed_blocks)
        # Hits on free blocks leave the free queue, so they count against what is free.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_required > self.block_pool.get_num_free_blocks() - num_revived:
            if not held:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        held.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_required, 0))
        held.extend(new_blocks)
        if state_pool is not None:
            state_pool.allocate(request.request_id)
        if self.enable_caching:
            self._cache_full_blocks(request, total_tokens)
        return new_blocks

    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(request, self.block_size, self.hash_fn)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # A block is cacheable once all its tokens are known; its KV is written in this step
        # before any attention reads it, so a hit in the same step is safe.
        self._update_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(
            blocks[start:num_full], request.block_hashes[start:num_full]
        )
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so a chain's tail is evicted first.

        request.num_computed_tokens must count only tokens whose KV was written: a request
        preempted after it was scheduled in this step still has the count of the last step.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        if self.state_pool is not None:
            self.state_pool.free(request.request_id)
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        self.block_pool.free_blocks(reversed(blocks))
        # Blocks are cached when scheduled, before their KV is written, so that requests
        # admitted in the same step share them. A request preempted after it was scheduled
        # never writes them: their hashes would name garbage, so they are forgotten now.
        num_computed_blocks = request.num_computed_tokens // self.block_size
        for block in blocks[num_computed_blocks:num_cached]:
            if block.ref_cnt == 0:
                self.block_pool.evict_cached_block(block)

    def take_kv_transfers(self) -> KVTransfers | None:
        """The disk cache's block loads and saves for the step being scheduled (None: none)."""
        disk = self.block_pool.disk
        return disk.take_transfers() if disk is not None else None

    def disk_stats(self) -> dict[str, int]:
        """The disk cache's counters, as SchedulerStats names them (empty without one)."""
        disk = self.block_pool.disk
        if disk is None:
            return {}
        return {
            "external_prefix_cache_queries": disk.queries,
            "external_prefix_cache_hits": disk.hits,
            "kv_disk_blocks_read": disk.blocks_read,
            "kv_disk_blocks_written": disk.blocks_written,
        }

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_state_slot(self, request_id: str) -> int | None:
        """The request's state slot (None: the model keeps no state, or it holds none)."""
        return self.state_pool.get_slot(request_id) if self.state_pool is not None else None

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Ref counts equal the number of requests holding each block, and the pool agrees."""
        holders = Counter(b.block_id for blocks in self.req_to_blocks.values() for b in blocks)
        self.block_pool.check_invariants(dict(holders))
        for req_id, blocks in self.req_to_blocks.items():
            assert len({b.block_id for b in blocks}) == len(blocks), f"{req_id} holds a block twice"
            num_cached = self.num_cached_blocks.get(req_id, 0)
            assert num_cached <= len(blocks), f"{req_id} cached more blocks than it holds"
        if self.state_pool is not None:
            self.state_pool.check_invariants()
            assert set(self.state_pool.req_to_slot) == set(self.req_to_blocks), (
                "a request holds blocks without a state slot, or a slot without blocks"
            )
