"""The LoRA part of one linear layer: every slot's A and B, and the product it adds.

A slot holds one adapter. A fused layer (q/k/v, gate/up) holds one LoRA per projection,
each with its own A: the slot's A stacks them ([n * max_rank, in]) and its B places each
projection's B in that projection's output rows and rank columns ([out, n * max_rank], zero
elsewhere), so one pair of products serves the fused layer. Under tensor parallelism B
keeps this rank's output rows (column-parallel layers) or A this rank's input columns
(row-parallel ones, whose partial sums the layer's all-reduce then adds up, deltas
included). The scaling is folded into B when a slot is filled.

On the CPU in float32 the delta comes from a C kernel (cpu_kernels.lora_add: B read only
where a projection has its LoRA) whose rows do not depend on each other, so batching and
chunking never change a row's delta (as the GGUF layers' integer products do not); a step
whose rows all take one adapter makes one call, which a replayed decode step (cpu_graph.py)
can make from C like the layer's other kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.kernels import cpu_kernels
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    RowParallelLinear,
)


@dataclass
class LoRABatch:
    """Which rows of this step's tokens each slot adapts: (slot, rows), rows None for all of
    them; empty when no scheduled request has an adapter. Shared by every layer."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


@dataclass(frozen=True)
class LoRASlice:
    """One projection of a layer: where its rows are in this rank's output (offset, size),
    and the first row of the checkpoint's full projection that this rank holds."""

    shard_id: object
    offset: int
    size: int
    start: int
    full_size: int


def layer_slices(layer: LinearBase) -> list[LoRASlice]:
    if isinstance(layer, MergedColumnParallelLinear):
        return [
            LoRASlice(shard_id, offset, size, start, size * layer.full_shard_multiple(shard_id))
            for shard_id, (offset, size, start) in layer.shard_layout.items()
        ]
    if isinstance(layer, ColumnParallelLinear):
        size = layer.output_size_per_partition
        return [LoRASlice(None, 0, size, layer.tp.rank * size, layer.output_size)]
    return [LoRASlice(None, 0, layer.output_size, 0, layer.output_size)]


class LinearLoRA:
    def __init__(
        self,
        layer: LinearBase,
        max_loras: int,
        max_rank: int,
        batch: LoRABatch,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.slices = layer_slices(layer)
        self.by_shard = {s.shard_id: i for i, s in enumerate(self.slices)}
        self.max_rank = max_rank
        self.batch = batch
        self.input_size = layer.input_size
        # Row-parallel: this rank's input columns (start, size) of A.
        self.input_cut = None
        if isinstance(layer, RowParallelLinear):
            size = layer.in_features_per_rank
            self.input_cut = (layer.tp.rank * size, size)
        local_in = self.input_cut[1] if self.input_cut else layer.input_size
        local_out = sum(s.size for s in self.slices)
        rank_width = len(self.slices) * max_rank
        self.lora_a = torch.zeros(max_loras, rank_width, local_in, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, local_out, rank_width, dtype=dtype, device=device)
        ends = [s.offset + s.size for s in self.slices]
        self.slice_ends = torch.tensor(ends, dtype=torch.int64)
        self.lib = None
        if cpu_kernels.is_cpu_f32(self.lora_a):
            self.lib = cpu_kernels.load_kernels("MINIVLLM_CPU_LAYER_KERNELS")

    def check(self, shard_id, a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        """A ValueError unless (A, B) fit projection shard_id of this layer."""
        if shard_id not in self.by_shard:
            raise ValueError(f"The adapter's module {name!r} is not a projection of this model.")
        full_out = self.slices[self.by_shard[shard_id]].full_size
        if a.shape[1] != self.input_size or b.shape[0] != full_out:
            raise ValueError(
                f"The adapter's module {name!r} maps {a.shape[1]} -> {b.shape[0]} features; "
                f"the model's maps {self.input_size} -> {full_out} (an adapter of another model?)."
            )

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def fill(self, slot: int, shard_id, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Projection shard_id's LoRA into the slot (after check() and clear())."""
        index = self.by_shard[shard_id]
        piece = self.slices[index]
        rank = a.shape[0]
        columns = slice(index * self.max_rank, index * self.max_rank + rank)
        if self.input_cut is not None:
            a = a.narrow(1, *self.input_cut)
        self.lora_a[slot, columns].copy_(a)
        rows = b.narrow(0, piece.start, piece.size) * scaling
        self.lora_b[slot, piece.offset : piece.offset + piece.size, columns].copy_(rows)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each row's adapter's x A^T B^T (rows without an adapter: nothing)."""
        kernel = self.lib is not None and x.dtype == out.dtype == torch.float32
        for slot, rows in self.batch.groups:
            a, b = self.lora_a[slot], self.lora_b[slot]
            if kernel and rows is None and x.is_contiguous() and out.is_contiguous():
                cpu_kernels.lora_add(self.lib, x, a, b, out, self.max_rank, self.slice_ends)
            elif kernel:  # some rows: their deltas apart, then added (the same sums)
                xs = (x if rows is None else x[rows]).contiguous()
                delta = out.new_zeros(xs.shape[0], out.shape[1])
                cpu_kernels.lora_add(self.lib, xs, a, b, delta, self.max_rank, self.slice_ends)
                if rows is None:
                    out += delta
                else:
                    out.index_add_(0, rows, delta)
            elif rows is None:  # one adapter for the whole step: two ops
                out.addmm_(x @ a.T, b.T)
            else:
                out.index_add_(0, rows, (x[rows] @ a.T) @ b.T)
