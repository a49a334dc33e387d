"""Each request's KV cache blocks, as rows of one array (the InputBatch's)."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Block ids per row: ``table`` [max_num_seqs, max_blocks_per_req] int32."""

    def __init__(self, max_num_seqs: int, max_blocks_per_req: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.table = np.zeros((max_num_seqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)

    def add_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"a request holds {end} blocks, more than max_model_len allows "
                f"({self.max_blocks_per_req} blocks of {self.block_size} tokens)"
            )
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.num_blocks[src])
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = n

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat cache slot of each (row, position): block ``table[row, p // bs]``, offset
        ``p % bs``."""
        bs = self.block_size
        blocks = self.table.ravel()[rows * self.max_blocks_per_req + positions // bs]
        return blocks.astype(np.int64) * bs + positions % bs
