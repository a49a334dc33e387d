"""Decode steps on a GPU replayed as CUDA graphs captured at start-up.

A step whose rows are all single tokens runs as the graph captured for the next padded
batch size (``device_buffers.capture_sizes``: 1, 2, 4, 8, then every 16 up to
max_num_seqs). The step's
inputs are already where the graphs read them: ``InputBatch.prepare`` writes them into
``GraphInputs`` and sends them in one copy (device_buffers.py); the spare rows of the
padded batch are requests of one token that write nothing to the KV cache (slot -1) and
read one key, and their outputs are dropped. The graph holds the whole step up to the
draw: the model's forward pass, the logits of every row (the LM head) and their argmax,
so a greedy step is one replay (``GraphOutput``); other sampling runs eagerly on the
replayed logits. Prefill chunks, batches larger than the largest size and
``enforce_eager`` run eagerly.

What a graph fixes at capture, so every step must agree with it: the buffers' addresses,
the batch size, the attention launch (grid, split-KV count chosen for max_model_len: a
split that finds no key of a shorter context adds nothing) and the block table's width
(max_model_len's blocks; the kernel reads only the blocks a context fills).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.sample.sampler import greedy_ids
from minivllm.worker.device_buffers import GraphInputs
from minivllm.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


class GraphOutput(NamedTuple):
    """A replay's outputs for the step's rows: the hidden states, and with the LM head in
    the graph each row's logits (float32) and their argmax (None without it)."""

    hidden: torch.Tensor
    logits: torch.Tensor | None
    greedy: torch.Tensor | None


class CudaGraphRunner:
    """One replay per size, over the static inputs of ``GraphInputs``.

    capture=False (the tests, on the CPU) captures nothing: a "replay" runs the same
    forward pass over the same static buffers eagerly, which checks the padding and the
    buffers' bookkeeping without a GPU. with_logits: the LM head and the argmax in the
    graph too (not with tensor parallelism: rank 0 alone has the logits).
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
        with_logits: bool = False,
    ) -> None:
        self.model = model
        self.captures = capture
        self.with_logits = with_logits
        self.attn_backend = attn_backend
        self.max_model_len = max_model_len
        self.device = device
        self.inputs = GraphInputs(sizes, -(-max_model_len // block_size), device)
        self.sizes = self.inputs.sizes
        self.replays: dict[int, Callable[[], GraphOutput]] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

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
                "Captured CUDA graphs for %d batch sizes (1-%d%s) in %.1f s.",
                len(self.sizes),
                self.max_size,
                ", with the LM head" if self.with_logits else "",
                time.perf_counter() - start,
            )

    def _capture(self, size: int, pool) -> Callable[[], GraphOutput]:
        dev = self.inputs.dev
        common = CommonAttentionMetadata(
            query_start_loc=self.inputs.query_start_loc[: size + 1],
            seq_lens=dev["seq_lens"][:size],
            block_table=dev["block_table"][:size],
            slot_mapping=dev["slot_mapping"][:size],
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(size, dtype=torch.int32),
        )
        metadata = self.attn_backend.build_metadata(common)
        model = self.model

        def forward() -> GraphOutput:
            hidden = model(dev["input_ids"][:size], dev["positions"][:size], metadata)
            if not self.with_logits:
                return GraphOutput(hidden, None, None)
            logits = model.compute_logits(hidden)
            return GraphOutput(hidden, logits, greedy_ids(logits))  # the sampler's own argmax

        if not self.captures:
            return forward
        # Warm-up outside the capture: Triton compiles its kernels, cuBLAS picks its own.
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward()

        def replay() -> GraphOutput:
            graph.replay()
            return output

        return replay

    def run(self, step: StepInputs) -> GraphOutput | None:
        """The step's outputs from a replay; None when it must run eagerly (its inputs are
        not in the graphs' buffers: a row of several tokens, or more rows than the largest
        graph)."""
        if step.graph_size is None:
            return None
        n = step.num_attn_rows  # the requests, or proposals' tokens as decode rows
        out = self.replays[step.graph_size]()
        if out.logits is None:
            return GraphOutput(out.hidden[:n], None, None)
        return GraphOutput(out.hidden[:n], out.logits[:n], out.greedy[:n])
