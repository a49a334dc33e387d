"""The tensor-parallel group's collectives between real processes: gloo on CPU, and NCCL
when this machine has two GPUs."""

from __future__ import annotations

import multiprocessing
import traceback

import pytest
import torch

from minivllm.distributed.parallel_state import (
    PPGroup,
    TPGroup,
    destroy_parallel_groups,
    get_open_port,
    init_parallel_groups,
)
from minivllm.platforms import get_platform


def _rank_main(rank: int, init_method: str, device: str, results) -> None:
    try:
        torch.set_num_threads(1)
        platform = get_platform(device)
        platform.init_device(rank)
        tp, _ = init_parallel_groups(rank, 2, 1, init_method, platform.dist_backend)
        dev = platform.device
        x = torch.full((2, 3), float(rank + 1), device=dev)
        summed = tp.all_reduce(x.clone())
        gathered = tp.all_gather(x, dim=-1)
        first = tp.gather_to_first(x, dim=0)
        ids = (
            torch.tensor([7, 8, 9], device=dev)
            if rank == 0
            else torch.empty(3, dtype=torch.long, device=dev)
        )
        ids = tp.broadcast_from_first(ids)
        results.put(
            (
                rank,
                summed.cpu().tolist(),
                gathered.cpu().tolist(),
                None if first is None else first.cpu().tolist(),
                ids.cpu().tolist(),
            )
        )
        destroy_parallel_groups()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def run_two_ranks(device: str) -> dict:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{get_open_port()}"
    procs = [
        ctx.Process(target=_rank_main, args=(rank, init_method, device, results), daemon=True)
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    try:
        out = {r[0]: r[1:] for r in (results.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, value in out.items():
        assert len(value) > 1, f"rank {rank} failed:\n{value[0]}"
    return out


def check(out: dict) -> None:
    for rank in range(2):
        summed, gathered, first, ids = out[rank]
        assert summed == [[3.0] * 3] * 2
        assert gathered == [[1.0] * 3 + [2.0] * 3] * 2
        assert ids == [7, 8, 9]
        assert first == ([[1.0] * 3] * 2 + [[2.0] * 3] * 2 if rank == 0 else None)


def test_one_rank_collectives_are_identities():
    tp = TPGroup()
    x = torch.randn(2, 3)
    assert tp.all_reduce(x) is x and tp.all_gather(x) is x
    assert tp.gather_to_first(x) is x and tp.broadcast_from_first(x) is x
    assert init_parallel_groups(0, 1, 1, "unused", "gloo") == (TPGroup(), PPGroup())


def test_gloo_between_cpu_processes():
    check(run_two_ranks("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_nccl_between_gpus():
    check(run_two_ranks("cuda"))
