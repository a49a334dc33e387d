"""A hybrid model's state cache in the runner's step: each step tells it the requests'
slots (zeroing those of requests that start at position 0) before the forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.worker.step import CachedRequestState, RunnerStep, StepFeature

if TYPE_CHECKING:
    from minivllm.model.layers.state_cache import StateCache


class StateCacheStep(StepFeature):
    """A state cannot take back a rejected proposal's tokens: no speculative decoding
    with it (ModelRunner.set_state_cache)."""

    def __init__(self, state_cache: StateCache, requests: dict[str, CachedRequestState]):
        self.state_cache = state_cache
        self.requests = requests

    def before_forward(self, step: RunnerStep) -> None:
        requests = self.requests
        slots = [requests[r].state_slot for r in step.req_ids]
        self.state_cache.begin_runner_step(slots, step.inputs)
