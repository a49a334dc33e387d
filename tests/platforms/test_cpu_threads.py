"""Fair CPU threads: the OpenMP wait policy reaches the environment before torch loads
libgomp (in-process and in the processes started from there), unless the user chose one;
``auto`` threads count the cores another process keeps busy (a busy loop from
tests/busy.py) and give them back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minivllm.platforms import cpu_threads
from tests.busy import busy_cores


def test_the_policy_is_in_the_environment_of_a_fresh_import(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    code = (
        "import minivllm, os; "
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    )
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    monkeypatch.setenv("MINIVLLM_CPU_OMP_WAIT_POLICY", "passive")
    assert run() == ["PASSIVE", "None"]
    monkeypatch.setenv("MINIVLLM_CPU_OMP_WAIT_POLICY", "bounded")
    assert run() == ["None", str(cpu_threads.BOUNDED_SPIN_COUNT)]
    monkeypatch.setenv("MINIVLLM_CPU_OMP_WAIT_POLICY", "spin")
    assert run() == ["None", "None"]
    monkeypatch.setenv("MINIVLLM_CPU_OMP_WAIT_POLICY", "passive")
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")  # the user's choice stays
    assert run() == ["None", "5"]


def test_free_cores_from_cpu_time(monkeypatch):
    readings = iter([(0.0, 100.0, 1.0), (2.0, 103.0, 2.0), (4.0, 103.4, 2.0)])
    monkeypatch.setattr(cpu_threads.FreeCores, "_reading", staticmethod(lambda: next(readings)))
    cores = cpu_threads.FreeCores()
    # 3 s of the machine's CPU time in 2 s, 1 of them ours: others kept one core busy.
    assert cores.free(2) == 1
    # 0.4 s in 2 s: others used a fifth of a core, so both cores are free.
    assert cores.free(2) == 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_busy_loop_takes_a_core_away():
    cores = cpu_threads.FreeCores()
    with busy_cores():
        cores.others_busy()  # from the loop's start
        import time

        time.sleep(1.0)
        busy = cores.others_busy()
    assert busy is not None and busy >= 0.8  # the loop's core at least (others may add)
