"""The tensor-parallel group a worker belongs to, passed to the layers that shard.

A layer is given a ``TPGroup`` when it is built and keeps it; nothing is read from a
module-global. The single-rank group (``TPGroup()``) makes every collective a no-op, so
the one-process path runs exactly the code it ran before tensor parallelism existed.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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


def init_tp_group(rank: int, size: int, init_method: str, backend: str) -> TPGroup:
    """Join the process group of ``size`` workers (one per rank) and return this rank's view;
    backend: the platform's (gloo between CPU processes, NCCL between GPUs)."""
    if size == 1:
        return TPGroup()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    return TPGroup(rank=rank, size=size, group=dist.group.WORLD)


def destroy_tp_group(tp: TPGroup) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS picks it; nothing fixed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
