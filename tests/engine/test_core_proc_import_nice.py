"""An engine core's start-up imports at a lower CPU priority (MINIVLLM_ENGINE_IMPORT_NICE):
on their own thread, so the core itself serves at its normal priority."""

import os
import sys
import threading

import pytest

from minivllm import envs
from minivllm.engine import core_proc

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux_only
def test_imports_run_niced_on_their_own_thread_and_the_caller_keeps_its_priority(monkeypatch):
    seen = {}

    def record() -> None:
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        seen["nice"] = _nice_of_this_thread()

    before = _nice_of_this_thread()
    monkeypatch.setattr(core_proc, "_import_engine", record)
    core_proc._import_engine_at_low_priority(5)
    assert seen["thread"]
    assert seen["nice"] == min(19, before + 5)
    assert _nice_of_this_thread() == before  # the busy loop's thread is untouched


def test_without_a_nice_the_imports_run_here(monkeypatch):
    seen = {}
    monkeypatch.setattr(
        core_proc, "_import_engine", lambda: seen.setdefault("thread", threading.get_ident())
    )
    core_proc._import_engine_at_low_priority(0)
    assert seen["thread"] == threading.get_ident()


def test_a_failed_import_is_left_to_the_build(monkeypatch):
    def fail() -> None:
        raise ImportError("no torch here")

    monkeypatch.setattr(core_proc, "_import_engine", fail)
    core_proc._import_engine_at_low_priority(3)  # no raise: the build reports it


def test_set_default_yields_to_the_users_value(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ENGINE_IMPORT_NICE", "3")  # restored after the test
    monkeypatch.delenv("MINIVLLM_ENGINE_IMPORT_NICE")
    envs.set_default("MINIVLLM_ENGINE_IMPORT_NICE", "10")
    assert envs.MINIVLLM_ENGINE_IMPORT_NICE == 10
    monkeypatch.setenv("MINIVLLM_ENGINE_IMPORT_NICE", "0")
    envs.set_default("MINIVLLM_ENGINE_IMPORT_NICE", "10")
    assert envs.MINIVLLM_ENGINE_IMPORT_NICE == 0
    with pytest.raises(ValueError):
        envs.set_default("MINIVLLM_ENGINE_IMPORT_NICE", "-1")
