"""vLLM's profiler hooks: a trace of the engine core with named ranges, only when asked."""

from __future__ import annotations

import contextlib
import glob
import json
import os

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine import profiler

RANGES = {"schedule", "prepare_inputs", "forward", "sample", "output_processing"}
PARAMS = SamplingParams(max_tokens=4, temperature=0)


def trace_names(folder: str) -> set[str]:
    traces = glob.glob(os.path.join(folder, "*.json"))
    assert len(traces) == 1, traces
    with open(traces[0]) as f:
        trace = json.load(f)
    return {event.get("name") for event in trace["traceEvents"]}


@pytest.mark.parametrize("variable", ["VLLM_TORCH_PROFILER_DIR", "MINIVLLM_TORCH_PROFILER_DIR"])
def test_a_profile_around_generate_leaves_a_trace_with_the_named_ranges(
    tiny_opt, tmp_path, monkeypatch, variable
):
    monkeypatch.delenv("MINIVLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.setenv(variable, str(tmp_path / "traces"))
    llm = LLM(tiny_opt, max_model_len=64)  # the engine core in its own process
    try:
        llm.generate(["warm up"], PARAMS, use_tqdm=False)
        assert not os.path.exists(tmp_path / "traces")  # nothing before start_profile
        llm.start_profile()
        llm.generate(["Hello, my name is"], PARAMS, use_tqdm=False)
        llm.stop_profile()
    finally:
        llm.llm_engine.shutdown()
    assert RANGES <= trace_names(str(tmp_path / "traces"))


def test_with_profiling_off_nothing_is_recorded(tiny_opt, monkeypatch):
    import torch

    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("MINIVLLM_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(tiny_opt, max_model_len=64, enable_multiprocessing=False)
    try:
        seen = []
        real_record = torch.profiler.record_function
        monkeypatch.setattr(
            torch.profiler, "record_function", lambda name: seen.append(name) or real_record(name)
        )
        llm.generate(["Hello"], PARAMS, use_tqdm=False)
        assert seen == []  # the ranges are no-ops: no profiler call at all
        assert isinstance(profiler.profile_range("forward"), contextlib.nullcontext)
        with pytest.raises(RuntimeError, match="VLLM_TORCH_PROFILER_DIR"):
            llm.start_profile()
    finally:
        llm.llm_engine.shutdown()
