"""The worker's side of the disk cache: it fills blocks from their files before a step and
copies blocks after it, writing the copies on a thread (the step never waits on the disk).

A block's payload is every layer's K and V of that block as this rank's cache holds them
(quantized ones included), layer after layer.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from minivllm.config import CacheConfig
from minivllm.kv_offload.disk_store import DiskStore
from minivllm.kv_offload.disk_tier import KVTransfers

logger = logging.getLogger(__name__)


class BlockDiskIO:
    def __init__(self, cache_config: CacheConfig, rank: int, kv_caches: list[torch.Tensor]):
        key = bytes.fromhex(cache_config.kv_cache_disk_key)
        self.store = DiskStore(
            cache_config.kv_cache_disk, key, rank, cache_config.kv_cache_disk_bytes
        )
        self.kv_caches = kv_caches  # each [2, num_blocks, ...]: keys then values
        self.writes: queue.Queue = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, daemon=True, name="kv-disk")
        self.writer.start()

    def _block_views(self, block_id: int) -> list[torch.Tensor]:
        return [cache[:, block_id] for cache in self.kv_caches]

    def load(self, transfers: KVTransfers | None) -> None:
        """Fill each block of the step's loads from its file (before the forward pass)."""
        if transfers is None:
            return
        for block_id, block_hash in transfers.loads:
            payload = self.store.read(block_hash)
            views = self._block_views(block_id)
            if payload is None or len(payload) != sum(v.numel() * v.element_size() for v in views):
                # The engine core found the file whole a moment ago; it went since.
                logger.error("KV disk cache: block %s could not be read back.", block_hash.hex())
                continue
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            offset = 0
            for view in views:
                target = view.view(torch.uint8)  # [2, block_size, Hkv, row bytes]
                target.copy_(data[offset : offset + target.numel()].view(target.shape))
                offset += target.numel()

    def save(self, transfers: KVTransfers | None) -> None:
        """Copy each block of the step's saves (after the forward pass) and queue its write."""
        if transfers is None or not transfers.saves:
            return
        for block_id, block_hash in transfers.saves:
            payload = b"".join(
                v.contiguous().view(torch.uint8).numpy().tobytes()
                for v in self._block_views(block_id)
            )
            self.writes.put((block_hash, payload))

    def _write_loop(self) -> None:
        while True:
            block_hash, payload = self.writes.get()
            try:
                self.store.write(block_hash, payload)
            except Exception:  # a write never fails a request
                logger.exception("KV disk cache: writing a block failed")
            finally:
                self.writes.task_done()

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self.writes.join()
