"""Every KV cache block, the O(1) free queue, and the hash -> block map of prefix caching."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from minivllm.core.kv_cache_utils import BlockHash

if TYPE_CHECKING:
    from minivllm.kv_offload.disk_tier import DiskTier


class KVCacheBlock:
    """One block of the paged KV cache; prev/next link it into the free queue (intrusive)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks: popleft, append and remove are all O(1).

    Blocks freed go to the tail and new blocks come from the head, so the least recently
    freed block is evicted first; a prefix-cache hit unlinks a block from the middle.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The free blocks from head (evicted next) to tail."""
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns all blocks; hands them out, takes them back and remembers their hashes.

    With a disk tier (--kv-cache-disk), a hash missing from memory is looked up on disk: a
    hit takes the least recently used free block, names it by the hash and has the workers
    fill it before the next step; it is then a free cached block like any other. A block
    that gets a hash is saved to disk after the step that computes it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, disk: DiskTier | None = None) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.disk = disk if enable_caching else None
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        block = self.cached_block_hash_to_block.get(block_hash)
        if block is None and self.disk is not None:
            block = self._block_from_disk(block_hash)
        return block

    def _block_from_disk(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A free block named by block_hash, to be filled from disk before the next step;
        None when the disk has no good copy or no block is free."""
        if not self.get_num_free_blocks() or not self.disk.has(block_hash):
            return None
        block = self.free_block_queue.popleft()
        self.evict_cached_block(block)
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        self.free_block_queue.append(block)  # free and findable, most recently used
        self.disk.load(block.block_id, block_hash)
        return block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, evicting their cached hash."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self.evict_cached_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def evict_cached_block(self, block: KVCacheBlock) -> None:
        """Forget the block's hash, so no lookup finds it again.

        Blocks handed out get this lazily: a freed block stays findable until then.
        """
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
            if self.disk is not None:
                self.disk.forget(block.block_id)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving the ones that were free."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash]) -> None:
        """Record the hash of each full block so later requests can share it."""
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None:
                continue  # already cached (a hit, or cached in an earlier step)
            if block_hash in self.cached_block_hash_to_block:
                continue  # another block holds the same content; keep the first
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            if self.disk is not None:
                self.disk.save(block.block_id, block_hash)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; the ones that reach zero go to the free tail.

        The first block given is the first of them to be evicted.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"{block} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        if self.get_num_free_blocks() != self.num_blocks:
            return False  # blocks in use keep their hashes
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def check_invariants(self, expected_ref_cnts: dict[int, int] | None = None) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent.

        expected_ref_cnts maps block id -> number of requests holding it (all others: 0).
        """
        free = list(self.free_block_queue)
        free_ids = {b.block_id for b in free}
        assert len(free) == len(free_ids) == self.free_block_queue.num_free_blocks, "free queue"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"{block}: free queue membership disagrees with its ref count"
            )
            if expected_ref_cnts is not None:
                want = expected_ref_cnts.get(block.block_id, 0)
                assert block.ref_cnt == want, f"{block}: ref count should be {want}"
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"{block} has a hash that does not map back to it"
                )
        hashed = [b for b in self.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.cached_block_hash_to_block), "hash map has stale entries"
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert used + len(free) == self.num_blocks, "free + used != total"
