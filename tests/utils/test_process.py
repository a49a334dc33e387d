"""minivllm.utils.process: spawning without the user's script, exits described, CPU threads."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys

import pytest

from minivllm.utils.process import (
    cpu_threads_plan,
    describe_exit,
    main_module_hidden,
    parse_cpu_list,
    spawn_process,
)


def test_describe_exit():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by signal SIGKILL"
    assert describe_exit(-200) == "was killed by signal 200"
    assert describe_exit(None) == "exited with code None"


def test_main_module_hidden_puts_everything_back():
    namespace = vars(sys.modules["__main__"])
    before = {k: namespace.get(k, "absent") for k in ("__spec__", "__file__")}
    with main_module_hidden():
        assert namespace["__spec__"] is None and "__file__" not in namespace
    assert {k: namespace.get(k, "absent") for k in ("__spec__", "__file__")} == before


def _report_threads(queue) -> None:
    import torch

    from minivllm.utils.process import set_cpu_threads

    set_cpu_threads(rank=1, ranks_here=2)
    queue.put((sorted(os.sched_getaffinity(0)), torch.get_num_threads()))


@pytest.mark.skipif(0 not in os.sched_getaffinity(0), reason="CPU 0 is not ours")
def test_a_spawned_rank_is_pinned_to_its_cpu_list(monkeypatch):
    # The child reads the variable through vLLM's name (the alias), for rank 1 of 2.
    monkeypatch.delenv("MINIVLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{max(os.sched_getaffinity(0))}|0")
    queue = multiprocessing.get_context("spawn").Queue()
    proc = spawn_process(_report_threads, name="ThreadsProbe", kwargs={"queue": queue})
    try:
        assert queue.get(timeout=120) == ([0], 1)
    finally:
        proc.join(30)
    assert proc.exitcode == 0


def test_cpu_threads_plan(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads_plan("auto", 0, 1) == (None, cores)
    assert cpu_threads_plan("auto", 1, 2) == (None, max(1, cores // 2))
    assert cpu_threads_plan("nobind", 0, 2) == (None, None)
    assert cpu_threads_plan("0-1|2-3", 1, 2) == ([2, 3], 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads_plan("auto", 0, 1) == (None, None)  # the user chose
    assert cpu_threads_plan("4,6", 0, 1) == ([4, 6], 2)  # a list still pins
    with pytest.raises(ValueError, match="one per rank"):
        cpu_threads_plan("0-1", 0, 2)


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("5") == [5]
    for bad in ("3-1", "a", "1-", ""):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpu_list(bad)
