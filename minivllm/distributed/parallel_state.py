"""The groups a worker belongs to: its tensor-parallel group, passed to the layers that
shard, and its pipeline stage, passed to the model that holds only the stage's layers.

A layer is given a ``TPGroup`` when it is built and keeps it; nothing is read from a
module-global. The single-rank group (``TPGroup()``) makes every collective a no-op, so
the one-process path runs exactly the code it ran before tensor parallelism existed; the
single stage (``PPGroup()``) holds every layer and sends nothing.

Ranks: a worker's global rank is ``stage * tensor_parallel_size + tp_rank``; each stage's
ranks form a tensor-parallel group, and tp rank t of stage s sends its activations to tp
rank t of stage s + 1 (after a row-parallel layer every tp rank holds the whole hidden
state).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from minivllm import envs


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed ProcessGroup; None with one rank

    @property
    def is_first(self) -> bool:
        """Rank 0 samples and answers the executor."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor along ``dim``, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's tensor along ``dim`` on rank 0; None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return torch.cat(parts, dim=dim) if self.is_first else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (filled in place elsewhere)."""
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x


@dataclass(frozen=True)
class PPGroup:
    """This worker's pipeline stage: which of ``size`` stages, and the global ranks it
    receives activations from and sends them to (None at the ends)."""

    rank: int = 0
    size: int = 1
    prev_rank: int | None = None
    next_rank: int | None = None

    @property
    def is_first(self) -> bool:
        """The first stage embeds the tokens."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """The last stage computes the logits, samples and answers the executor."""
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of this stage's layers (``stage_layer_counts``)."""
        counts = stage_layer_counts(num_layers, self.size)
        start = sum(counts[: self.rank])
        return start, start + counts[self.rank]

    def send(self, x: torch.Tensor) -> dist.Work | None:
        """Start sending x to the next stage; the handle's wait() says it left (keep x
        alive until then)."""
        return dist.isend(x.contiguous(), dst=self.next_rank)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """The previous stage's next tensor of this shape (sent in the same order)."""
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=self.prev_rank)
        return x


def stage_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """How many layers each stage holds: MINIVLLM_PP_LAYER_PARTITION's counts when set
    (vLLM's VLLM_PP_LAYER_PARTITION), else an even split with the remainder given to the
    stages before the last, from the one before it backwards (the last also computes the
    logits), as vLLM's get_pp_indices."""
    if num_stages == 1:
        return [num_layers]
    text = envs.MINIVLLM_PP_LAYER_PARTITION
    if text:
        try:
            counts = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(
                f"VLLM_PP_LAYER_PARTITION={text!r}: expected comma-separated layer counts"
            ) from None
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"VLLM_PP_LAYER_PARTITION={text!r} must give each of the {num_stages} "
                f"pipeline stages at least one layer, {num_layers} layers in all"
            )
        return counts
    counts = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):
        counts[-2 - i] += 1
    return counts


def init_parallel_groups(
    rank: int, tp_size: int, pp_size: int, init_method: str, backend: str
) -> tuple[TPGroup, PPGroup]:
    """Join the process group of every worker (``tp_size * pp_size``, one per rank) and
    return this rank's tensor-parallel group and pipeline stage; backend: the platform's
    (gloo between CPU processes, NCCL between GPUs)."""
    world = tp_size * pp_size
    if world == 1:
        return TPGroup(), PPGroup()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    stage, tp_rank = divmod(rank, tp_size)
    group = dist.group.WORLD
    if pp_size > 1 and tp_size > 1:
        # Every rank creates every stage's group, in the same order (a collective call).
        stages = [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(pp_size)]
        group = [dist.new_group(ranks) for ranks in stages][stage]
    tp = TPGroup(rank=tp_rank, size=tp_size, group=group) if tp_size > 1 else TPGroup()
    pp = PPGroup(
        rank=stage,
        size=pp_size,
        prev_rank=rank - tp_size if stage > 0 else None,
        next_rank=rank + tp_size if stage < pp_size - 1 else None,
    )
    return tp, pp


def destroy_parallel_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS picks it; nothing fixed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
