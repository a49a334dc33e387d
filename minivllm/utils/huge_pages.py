"""Host memory in transparent huge pages, for the tensors a decode step streams front to
back once a step (packed GGUF weights, recurrent states).

With 4 KiB pages the hardware prefetch stops at every page end and each page costs a TLB
walk; in 2 MiB pages one thread's Q4_0 products from memory reach 1.2-1.4x the GB/s (Zen 4,
BENCHMARKS.md). The map is private and anonymous (a shared one is shmem, which Linux never
backs with transparent huge pages), the tensor starts on a 2 MiB boundary and only its whole
2 MiB spans are madvised, so no huge page holds unused bytes."""

from __future__ import annotations

import mmap

import torch

from minivllm import envs

HUGE_PAGE = 2 * 2**20


def huge_page_bytes(nbytes: int) -> torch.Tensor | None:
    """A zeroed uint8 tensor of ``nbytes`` whose whole 2 MiB spans ask for huge pages, or
    None where there is no point or no way (under one huge page, ``MINIVLLM_CPU_HUGE_PAGES=0``,
    a system without ``madvise``): the caller then takes ordinary memory."""
    if nbytes < HUGE_PAGE or not envs.MINIVLLM_CPU_HUGE_PAGES:
        return None
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the map alive
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages all the same
        pass
    return whole[start : start + nbytes]
