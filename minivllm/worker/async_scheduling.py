"""Async scheduling in the runner's step: ``execute_model`` returns before the sampled
ids reach the host (an ``AsyncModelRunnerOutput``), and the next step takes them as inputs
on the device (``InputBatch.prepare``'s ``in_flight``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.core.sched_output import (
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from minivllm.platforms.interface import Platform
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.step import RunnerStep, StepFeature
from minivllm.worker.step_inputs import InFlightTokens


class AsyncScheduling(StepFeature):
    def __init__(
        self, batch: InputBatch, platform: Platform, generators: dict[str, torch.Generator]
    ) -> None:
        """generators: the seeded requests' (the runner's, kept across preemption)."""
        self.batch = batch
        self.platform = platform
        self.generators = generators
        self.in_flight: InFlightTokens | None = None  # the last step's, until collected

    def update_states(self, so: SchedulerOutput) -> None:
        if self.in_flight is not None:
            for req_id in so.preempted_req_ids:
                self._undo_draw(req_id)

    def prepare(self, step: RunnerStep) -> None:
        step.in_flight = self.in_flight
        generators = self.generators
        if generators:  # the draws a preemption may have to undo
            step.draw_states = {
                r: generators[r].get_state() for r in step.req_ids if r in generators
            }

    def _undo_draw(self, req_id: str) -> None:
        """A request preempted while its token is in flight: the scheduler drops that
        token, and the request computes it again once resumed. Its generator goes back to
        before the draw, so that the token is drawn from the same number as in a
        synchronous engine, where it would have been kept."""
        state = self.in_flight.draw_states.get(req_id)
        if state is not None:
            self.generators[req_id].set_state(state)

    def launch(
        self,
        step: RunnerStep,
        tensors: list[torch.Tensor],
        after_sample: tuple[Callable[[RunnerStep], None], ...],
        output: Callable[[RunnerStep, list[torch.Tensor]], ModelRunnerOutput],
    ) -> AsyncModelRunnerOutput:
        """The step's return path: the ids travel to the host behind this step's work; the
        next step is launched before anyone waits for them. tensors: the sampled ids, then
        the logprobs' tensors if asked; once the ids are on the host (``step.token_ids``),
        the after_sample hooks run and ``output(step, logprob tensors)`` builds the output."""
        batch = self.batch
        positions = batch.append_placeholders(step.sampling_rows)
        req_ids = [s.req_id for s in step.states]
        in_flight = InFlightTokens(req_ids, positions, tensors[0], step.draw_states)
        self.in_flight = in_flight
        host = tensors
        if not self.platform.host_is_device:
            host = [t.to("cpu", non_blocking=True) for t in tensors]
        copied = self.platform.record_event()

        def collect() -> ModelRunnerOutput:
            if copied is not None:
                copied.synchronize()  # this step's copies only, not the steps after it
            if self.in_flight is in_flight:
                self.in_flight = None  # the host has them: a later step reads them there
            step.token_ids = host[0].tolist()
            for hook in after_sample:
                hook(step)
            batch.set_tokens(in_flight.req_ids, positions, step.token_ids)
            return output(step, host[1:])

        return AsyncModelRunnerOutput(collect)
