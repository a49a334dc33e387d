"""The engine core's side of the disk cache: the block pool asks it on a miss whether a
block's hash has good files (one per tensor-parallel rank), and it gathers the loads and
saves the workers make around the next step (``take_transfers``). No torch: it reads
headers and checksums, the workers copy the bytes.

Rules: a block loaded from disk is filled before the step that sent its load computes
anything (the worker loads first), so it is a cache hit like any other; a block is saved
after the step whose scheduling hashed it has written it (the worker saves after the
forward pass, on a thread); a block evicted or re-used before its step was sent drops its
load or save.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from minivllm.config import CacheConfig
from minivllm.kv_offload.disk_store import DiskStore

logger = logging.getLogger(__name__)


@dataclass
class KVTransfers:
    """What the workers do around one step: (block id, block hash) pairs."""

    loads: list[tuple[int, bytes]] = field(default_factory=list)  # before the forward pass
    saves: list[tuple[int, bytes]] = field(default_factory=list)  # after it


class DiskTier:
    def __init__(self, stores: list[DiskStore], block_size: int) -> None:
        self.stores = stores  # one per rank
        self.block_size = block_size
        self.pending_loads: dict[int, bytes] = {}
        self.pending_saves: dict[int, bytes] = {}
        # Counters (cumulative): tokens looked up on disk after a miss in memory, tokens
        # found there (vLLM's external prefix cache), blocks read and blocks written.
        self.queries = 0
        self.hits = 0
        self.blocks_read = 0
        self.blocks_written = 0

    @classmethod
    def from_cache_config(cls, cache_config: CacheConfig) -> DiskTier | None:
        """The tier --kv-cache-disk asks for (None without it)."""
        if not cache_config.kv_cache_disk:
            return None
        key = bytes.fromhex(cache_config.kv_cache_disk_key)
        stores = [
            DiskStore(cache_config.kv_cache_disk, key, rank, cache_config.kv_cache_disk_bytes)
            for rank in range(cache_config.kv_cache_disk_ranks)
        ]
        logger.info(
            "KV disk cache under %s (%.1f GiB at most), model key %s",
            cache_config.kv_cache_disk,
            cache_config.kv_cache_disk_bytes / (1 << 30),
            key.hex()[:16],
        )
        return cls(stores, cache_config.block_size)

    def has(self, block_hash: bytes) -> bool:
        """Whether every rank's file of the block is there and whole (bad ones are removed)."""
        self.queries += self.block_size
        if all(store.read(block_hash, payload=False) is not None for store in self.stores):
            self.hits += self.block_size
            return True
        return False

    def load(self, block_id: int, block_hash: bytes) -> None:
        """Fill block_id from disk before the next step."""
        self.pending_loads[block_id] = block_hash
        self.blocks_read += 1

    def save(self, block_id: int, block_hash: bytes) -> None:
        """Write block_id to disk after the next step has computed it."""
        if not self.stores[0].writes_stopped:
            self.pending_saves[block_id] = block_hash

    def forget(self, block_id: int) -> None:
        """The block lost its hash before its transfers went out: they would be wrong."""
        if self.pending_loads.pop(block_id, None) is not None:
            self.blocks_read -= 1
        self.pending_saves.pop(block_id, None)

    def take_transfers(self) -> KVTransfers | None:
        """This step's loads and saves (None when there are none), and forget them."""
        if not self.pending_loads and not self.pending_saves:
            return None
        transfers = KVTransfers(list(self.pending_loads.items()), list(self.pending_saves.items()))
        self.blocks_written += len(self.pending_saves)
        self.pending_loads.clear()
        self.pending_saves.clear()
        return transfers
