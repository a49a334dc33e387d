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
    omp_thread_pinning_env,
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


def test_omp_thread_pinning_env(monkeypatch):
    for name in ("GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    assert omp_thread_pinning_env([2, 3]) == {"GOMP_CPU_AFFINITY": "2 3"}
    assert omp_thread_pinning_env(None) == {}  # auto / nobind: threads left where they are
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    assert omp_thread_pinning_env([2, 3]) == {}  # the user placed them


def _report_thread_cpus(queue) -> None:
    import torch

    torch.set_num_threads(2)  # (the main thread is pinned to one CPU already)
    torch.ones(512, 512) @ torch.ones(512, 512)  # starts the OpenMP team
    cpus = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
        cpus.append(line.split(":")[1].strip())
    queue.put((os.environ.get("GOMP_CPU_AFFINITY"), cpus))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_spawned_child_gets_its_omp_threads_pinned_one_per_cpu(monkeypatch):
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch does not run on OpenMP here")
    for name in ("GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    first, second = sorted(os.sched_getaffinity(0))[:2]
    env = omp_thread_pinning_env([first, second])
    queue = multiprocessing.get_context("spawn").Queue()
    proc = spawn_process(_report_thread_cpus, "PinProbe", {"queue": queue}, env=env)
    try:
        seen, cpus = queue.get(timeout=120)
    finally:
        proc.join(30)
    assert "GOMP_CPU_AFFINITY" not in os.environ  # ours is left as it was
    assert seen == f"{first} {second}"
    # The main thread (OpenMP thread 0) on the first CPU, the team's other thread on the
    # second: each thread on one CPU, not the two sharing both.
    assert str(first) in cpus and str(second) in cpus
