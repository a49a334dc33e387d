"""Pooling in the runner's step (the pooling runner: every request is pooled, none
sampled): the hidden rows go to each request's pooling, and the step ends with the
embeddings of the requests whose prompt it finished."""

from __future__ import annotations

import torch

from minivllm.core.sched_output import ModelRunnerOutput
from minivllm.distributed.parallel_state import TPGroup
from minivllm.engine.profiler import profile_range
from minivllm.worker.pooler import Pooler
from minivllm.worker.step import CachedRequestState, RunnerStep, StepFeature


class PoolingStep(StepFeature):
    def __init__(
        self, pooler: Pooler, requests: dict[str, CachedRequestState], tp: TPGroup
    ) -> None:
        self.pooler = pooler
        self.requests = requests
        self.tp = tp

    def after_forward(self, step: RunnerStep) -> None:
        with profile_range("pool"):
            pooled = self._pool(step, step.hidden)
        req_ids = step.req_ids
        step.output = ModelRunnerOutput(req_ids, [[] for _ in req_ids], pooler_output=pooled)

    def _pool(self, step: RunnerStep, hidden: torch.Tensor) -> dict[str, list[float]]:
        """Give each request's rows to its pooling; the embeddings of those whose prompt
        this step finished (the rows that would sample), on tensor-parallel rank 0."""
        inputs = step.inputs
        if self.pooler.reads_every_chunk:
            starts = inputs.query_start_loc_cpu.tolist()
            for i, req_id in enumerate(step.req_ids):
                first_position = int(inputs.positions_cpu[starts[i]])
                rows = hidden[starts[i] : starts[i + 1]]
                self.pooler.add_chunk(self.requests[req_id].pooling, rows, first_position)
        if not len(inputs.sampling) or not self.tp.is_first:
            return {}
        done = [step.req_ids[i] for i in inputs.sampling.tolist()]
        states = [self.requests[req_id].pooling for req_id in done]
        return dict(zip(done, self.pooler.pool(states, hidden[inputs.logits_indices])))
