"""Starting, watching and stopping the engine's child processes, and their CPU threads.

The engine core and the tensor-parallel workers run in processes started with the spawn
method; each exits by itself when its parent is gone, so none outlives the engine.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from minivllm import envs

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Start spawned processes without re-running the user's script in them.

    spawn runs the parent's ``__main__`` file again in the child (as ``__mp_main__``) so
    that objects defined there unpickle. Our children need nothing from it, and a script
    without an ``if __name__ == "__main__":`` guard would create a second engine in each.
    spawn finds the script through ``__spec__`` and ``__file__``: hidden while the child's
    start-up data is written, then put back.
    """
    namespace = vars(sys.modules["__main__"])
    saved = {k: namespace[k] for k in ("__spec__", "__file__") if k in namespace}
    namespace["__spec__"] = None
    namespace.pop("__file__", None)
    try:
        yield
    finally:
        namespace.pop("__spec__", None)
        namespace.update(saved)


def spawn_process(
    target: Callable[..., None],
    name: str,
    kwargs: dict,
    daemon: bool = False,
    env: dict[str, str] | None = None,
) -> multiprocessing.process.BaseProcess:
    """Start ``target(**kwargs)`` in a new process (spawn method, the script not re-run);
    ``env`` is added to the environment the child starts with (ours is left as it was)."""
    proc = multiprocessing.get_context("spawn").Process(
        target=target, name=name, kwargs=kwargs, daemon=daemon
    )
    with main_module_hidden(), _environment_added(env or {}):
        proc.start()
    return proc


@contextlib.contextmanager
def _environment_added(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, for a message: 'exited with code 1', 'was killed by signal ...'."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def parent_alive(parent_pid: int) -> bool:
    # A dead parent's children are re-parented (to init or a subreaper).
    return os.getppid() == parent_pid


def exit_when_orphaned(parent_pid: int) -> None:
    """Start a thread that exits this process (code 1) once its parent is gone, even while
    the main thread is stuck (in a collective, say)."""

    def watch() -> None:
        while True:
            time.sleep(_PARENT_POLL_S)
            if not parent_alive(parent_pid):
                os._exit(1)

    threading.Thread(target=watch, name="ParentWatch", daemon=True).start()


# ------------------------------------------------------------------ CPU threads


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r} (e.g. 0-3,6)") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"not a CPU list: {text!r} (e.g. 0-3,6)")
        cpus.extend(range(lo, hi + 1))
    return cpus


def cpu_threads_plan(bind: str, rank: int, ranks_here: int) -> tuple[list[int] | None, int | None]:
    """What MINIVLLM_CPU_OMP_THREADS_BIND asks of one rank's process: (the CPUs to pin it
    to, or None; the number of threads, or None to leave torch's own)."""
    if bind == "nobind":
        return None, None
    if bind == "auto":
        if "OMP_NUM_THREADS" in os.environ:
            return None, None  # the user chose
        return None, max(1, len(os.sched_getaffinity(0)) // ranks_here)
    lists = bind.split("|")
    if len(lists) < ranks_here:
        raise ValueError(
            f"MINIVLLM_CPU_OMP_THREADS_BIND={bind!r} names {len(lists)} CPU list(s) for "
            f"{ranks_here} ranks: give one per rank, separated by '|'."
        )
    cpus = parse_cpu_list(lists[rank])
    return cpus, len(cpus)


# Variables through which the user already placed the OpenMP threads.
_OMP_PLACEMENT_VARS = ("GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY")


def omp_thread_pinning_env(cpus: list[int] | None) -> dict[str, str]:
    """The environment that binds a child's OpenMP thread i to cpus[i], as vLLM's
    VLLM_CPU_OMP_THREADS_BIND=<cores> does (GOMP_CPU_AFFINITY; libgomp reads it when it
    loads, so it must be in the child's environment from the start). Pinning only the
    process (sched_setaffinity) lets the threads migrate and pile onto one core when another
    process wants a core: the frontend, a client, other work. Empty without a core list,
    or when the user placed the threads already."""
    if cpus is None or any(name in os.environ for name in _OMP_PLACEMENT_VARS):
        return {}
    return {"GOMP_CPU_AFFINITY": " ".join(str(cpu) for cpu in cpus)}


def set_cpu_threads(rank: int = 0, ranks_here: int = 1) -> None:
    """Give this process its CPU threads, as MINIVLLM_CPU_OMP_THREADS_BIND says: by default
    an equal share of the allowed cores for each of the ``ranks_here`` ranks on this
    machine (one thread each on 2 cores), unless OMP_NUM_THREADS is set."""
    cpus, threads = cpu_threads_plan(envs.MINIVLLM_CPU_OMP_THREADS_BIND, rank, ranks_here)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
        logger.info("rank %d pinned to CPUs %s", rank, cpus)
    if threads is not None:
        import torch  # only in the processes that run the model

        torch.set_num_threads(threads)
