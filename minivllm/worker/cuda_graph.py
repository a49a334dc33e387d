"""Decode steps on a GPU replayed as CUDA graphs captured at start-up.

A step whose rows are all single tokens runs as the graph captured for the next padded
batch size (``capture_sizes``: 1, 2, 4, 8, then every 16 up to max_num_seqs). The step's
inputs are copied into the graphs' static buffers; the spare rows of the padded batch are
requests of one token that write nothing to the KV cache (slot -1) and read one key of
block 0, and their outputs are dropped. Only the model's forward pass is captured: logits
and sampling run eagerly on the replayed output. Prefill chunks, batches larger than the
largest size and ``enforce_eager`` run eagerly.

What a graph fixes at capture, so every step must agree with it: the buffers' addresses,
the batch size, the attention launch (grid, split-KV count chosen for max_model_len: a
split that finds no key of a shorter context adds nothing) and the block table's width
(max_model_len's blocks; the kernel reads only the blocks a context fills).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, 8, then every 16, as far as a decode step
    can go (one token per sequence)."""
    limit = min(max_num_seqs, max_num_batched_tokens)
    return [s for s in (1, 2, 4, 8, *range(16, limit + 1, 16)) if s <= limit]


class CudaGraphRunner:
    """Static input buffers sized for the largest graph, and one replay per size.

    capture=False (the tests, on the CPU) captures nothing: a "replay" runs the same
    forward pass over the same static buffers eagerly, which checks the padding and the
    buffers' bookkeeping without a GPU.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.captures = capture
        self.attn_backend = attn_backend
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.device = device
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        zeros = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, **zeros)
        self.positions = torch.zeros(n, dtype=torch.int64, **zeros)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, **zeros)
        self.seq_lens = torch.ones(n, dtype=torch.int32, **zeros)
        # One token per request: request i's query is row i, always.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, **zeros)
        self.block_table = torch.zeros(n, max_blocks, dtype=torch.int32, **zeros)
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a batch of num_reqs single-token rows runs as; None: eager."""
        return next((s for s in self.sizes if s >= num_reqs), None)

    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (a step replays one
        graph and reads its output before the next replay, so they may share memory)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.captures else None
        for size in reversed(self.sizes):
            self.replays[size] = self._capture(size, pool)
        if self.captures:
            torch.cuda.synchronize()
            logger.info(
                "Captured CUDA graphs for %d batch sizes (1-%d) in %.1f s.",
                len(self.sizes),
                self.max_size,
                time.perf_counter() - start,
            )

    def _capture(self, size: int, pool) -> Callable[[], torch.Tensor]:
        common = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(size, dtype=torch.int32),
        )
        metadata = self.attn_backend.build_metadata(common)

        def forward() -> torch.Tensor:
            return self.model(self.input_ids[:size], self.positions[:size], metadata)

        if not self.captures:
            return forward
        # Warm-up outside the capture: Triton compiles its kernels, cuBLAS picks its own.
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    def run(self, step: StepInputs) -> torch.Tensor | None:
        """The step's hidden states from a replay; None when it must run eagerly (a row of
        several tokens, or more rows than the largest graph)."""
        n = step.num_attn_rows  # the requests, or proposals' tokens as decode rows
        size = self.padded_size(n) if step.max_query_len == 1 else None
        if size is None:
            return None
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[:n].copy_(step.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(step.seq_lens)
        self.seq_lens[n:size].fill_(1)
        self.block_table[:n, : step.block_table.shape[1]].copy_(step.block_table)
        return self.replays[size]()[:n]
