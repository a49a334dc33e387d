"""vLLM's profiler hooks: a torch.profiler trace of the engine core process, on request.

`start()` / `stop()` bracket what is recorded; `stop()` writes a Chrome trace (plain JSON,
readable by chrome://tracing, Perfetto or `json.load`) into MINIVLLM_TORCH_PROFILER_DIR
(or vLLM's VLLM_TORCH_PROFILER_DIR). `profile_range(name)` marks a step's phases in that
trace; while no profile runs it is a no-op, so an engine that never profiles records nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time

import torch

from minivllm import envs

logger = logging.getLogger(__name__)

# The profile running in this process, if any: profile_range records only inside one.
_active: torch.profiler.profile | None = None


def profile_range(name: str) -> contextlib.AbstractContextManager:
    """A named range in the running profile's trace; nothing at all when none runs."""
    if _active is None:
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)


class TorchProfiler:
    """Starts and stops this process's profile; one at a time."""

    def __init__(self, trace_dir: str) -> None:
        self.trace_dir = trace_dir
        self.last_trace: str | None = None

    @classmethod
    def from_env(cls) -> TorchProfiler | None:
        trace_dir = envs.MINIVLLM_TORCH_PROFILER_DIR
        return None if trace_dir is None else cls(trace_dir)

    def start(self) -> None:
        global _active
        if _active is not None:
            raise RuntimeError("A profile is already running; stop it first.")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=False)
        profile.start()
        _active = profile
        logger.info("Profiling started; the trace goes to %s", self.trace_dir)

    def stop(self) -> str:
        """End the profile and write its trace; returns the trace file's path."""
        global _active
        if _active is None:
            raise RuntimeError("No profile is running; start one first.")
        profile, _active = _active, None
        profile.stop()
        os.makedirs(self.trace_dir, exist_ok=True)
        name = f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json"
        path = os.path.join(self.trace_dir, name)
        profile.export_chrome_trace(path)
        self.last_trace = path
        logger.info("Profiling stopped; trace written to %s", path)
        return path


def profiling_off_error() -> RuntimeError:
    return RuntimeError(
        "Profiling is off: set VLLM_TORCH_PROFILER_DIR (or MINIVLLM_TORCH_PROFILER_DIR) to a "
        "folder for the traces before starting the engine."
    )
