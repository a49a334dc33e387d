"""A competing process for tests and benchmarks: busy loops pinned to chosen cores, as
`stress --cpu` makes, so the engine shares its machine as on a laptop running a browser."""

from __future__ import annotations

import contextlib
import multiprocessing
import os


def _spin(cpu: int) -> None:
    os.sched_setaffinity(0, [cpu])
    while True:
        pass


@contextlib.contextmanager
def busy_cores(cpus: list[int] | None = None):
    """Busy loops, one process pinned to each of ``cpus`` (default: the last allowed core)
    while the block runs; killed on the way out."""
    if cpus is None:
        cpus = [max(os.sched_getaffinity(0))]
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_spin, args=(cpu,), daemon=True) for cpu in cpus]
    for proc in procs:
        proc.start()
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
