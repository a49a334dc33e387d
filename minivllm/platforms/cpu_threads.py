"""CPU threads that share a machine fairly: OpenMP threads that do not spin-wait, and a
thread count that follows the cores other processes leave free.

On a core that another process also wants, a thread that spin-waits at the end of a
parallel region keeps its own core busy while the thread it waits for is descheduled: the
region lasts a scheduler time slice (milliseconds) instead of microseconds, and a decode
step, hundreds of regions, slows 10-50x. With a bounded spin the waiting thread sleeps
soon, and the kernel can move the late thread to the core it freed. libgomp reads its
wait policy once, when it is loaded (with torch), so the policy is set in the environment
at ``import minivllm``, before torch in this process and in every process it starts.

``auto`` threads: one per allowed core that other processes do not keep busy (measured
from /proc/stat), checked again every few seconds while the engine runs, so a browser or a
build that starts later takes a thread away and gives it back when it ends.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

# The default is bounded. On a quiet machine (Zen 4, 2 cores, bundled model, one stream's
# median time per token over alternating runs) spinning took 6.1-6.6 ms, bounded 6.2-6.7
# and passive 12.1: a passive thread is woken by a futex at every one of a step's hundreds
# of parallel regions. With a fixed thread count on 2 cores shared with ~25 runnable
# processes, one stream decoded 32 tokens/s passive, 1.9 bounded, 0.2 spinning
# (benchmarks/busy_decode.py, relative figures only); the default `auto` thread count
# drops threads a busy machine takes instead, so no thread waits on a descheduled one.
# libgomp's spin count before a waiting thread sleeps (its own default is 300,000 spins,
# about a millisecond; ACTIVE is 30 billion). Enough spins to bridge the gap between two
# kernels of a step on a quiet machine, few enough that a thread whose partner lost its
# core sleeps almost at once.
BOUNDED_SPIN_COUNT = 10_000
WAIT_POLICIES = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "bounded": {"GOMP_SPINCOUNT": str(BOUNDED_SPIN_COUNT)},
    "spin": {},  # libgomp's own default
}
# Variables through which the user already chose the OpenMP runtime's waiting.
_USER_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def omp_wait_policy_env(policy: str) -> dict[str, str]:
    """The environment for ``policy`` (MINIVLLM_CPU_OMP_WAIT_POLICY); empty when the user
    set the runtime's own variables."""
    if any(name in os.environ for name in _USER_WAIT_VARS):
        return {}
    return dict(WAIT_POLICIES[policy])


def apply_omp_wait_policy(policy: str) -> None:
    """Put the wait policy in this process's environment: read by libgomp when torch loads
    it (here, if torch is not imported yet, and in the processes started from here)."""
    os.environ.update(omp_wait_policy_env(policy))


def _cpu_seconds_of_everyone() -> float | None:
    """CPU time (s) all processes have used, busy states only (/proc/stat's first line)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


class FreeCores:
    """How many of the allowed cores other processes leave free, from the CPU time the
    whole machine used between two readings minus what this process used."""

    def __init__(self) -> None:
        self._last = self._reading()

    @staticmethod
    def _reading() -> tuple[float, float | None, float]:
        return time.monotonic(), _cpu_seconds_of_everyone(), time.process_time()

    def others_busy(self) -> float | None:
        """Cores' worth of CPU time other processes used since the last call (None where
        /proc/stat cannot be read)."""
        now = self._reading()
        (t0, all0, own0), (t1, all1, own1) = self._last, now
        self._last = now
        if all0 is None or all1 is None or t1 - t0 <= 0:
            return None
        return max(0.0, (all1 - all0) - (own1 - own0)) / (t1 - t0)

    def free(self, allowed: int) -> int:
        """Allowed cores minus the ones others keep busy (rounded: a core half used by
        others still counts as free), at least 1."""
        busy = self.others_busy()
        if busy is None:
            return allowed
        return max(1, min(allowed, allowed - int(busy + 0.5)))


class AutoThreads:
    """Keeps torch's (and so the kernels') thread count at the free cores, re-read every
    ``interval`` seconds; call ``update`` from the thread that runs the model, once a step
    (it costs a clock read between checks)."""

    def __init__(self, allowed: int, interval: float = 2.0) -> None:
        self.allowed = allowed
        self.interval = interval
        self._cores = FreeCores()
        self._next = time.monotonic() + interval
        self.threads = allowed

    def update(self) -> int:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval
            threads = self._cores.free(self.allowed)
            if threads != self.threads:
                import torch

                torch.set_num_threads(threads)
                logger.info(
                    "CPU threads: %d (other processes keep %d of %d cores busy)",
                    threads,
                    self.allowed - threads,
                    self.allowed,
                )
                self.threads = threads
        return self.threads
