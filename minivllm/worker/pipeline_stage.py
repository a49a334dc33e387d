"""One pipeline stage's part of a step: the activations in from the stage before, out to
the stage after, and, on a stage that does not sample, the step's end.

``StageModel`` wraps the stage's model for the runner: a stage after the first receives
the residual stream (hidden states and residual, one [2, tokens, hidden] tensor) before
its layers run; a stage before the last starts sending its own after them and returns
None. Sends are asynchronous (the stage goes on to the next batch while the next stage
reads it); each waits for the one before, which bounds what is buffered to one batch.
Every stage runs the same steps in the same order, so a tensor is matched with its step
by order alone.

``PipelineStageStep`` is the runner feature of a stage that does not sample: it writes
the tokens the scheduler says were sampled since a request's last step (the last stage
sampled them; ``CachedRequestData.new_token_ids``) and ends the step after the forward.
"""

from __future__ import annotations

import time

import torch

from minivllm.core.sched_output import ModelRunnerOutput
from minivllm.distributed.parallel_state import PPGroup
from minivllm.model.models.llama import IntermediateTensors
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.step import RunnerStep, StepFeature


class StageModel:
    """The runner's model on a pipeline stage (see the module's docstring)."""

    # The forward waits on another process: no CUDA graph, and (no embed_input_ids) no
    # CPU graph records it.
    supports_cuda_graphs = False

    def __init__(
        self, model: torch.nn.Module, pp: PPGroup, hidden_size: int, dtype: torch.dtype, device
    ) -> None:
        self.model = model
        self.pp = pp
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._sending: tuple[torch.Tensor, object] | None = None  # the send in progress
        # Seconds spent waiting for the stage before (and for a send to leave): the stage
        # is idle then (benchmarks/pipeline_parallel.py reads it).
        self.wait_seconds = 0.0

    def __call__(self, input_ids, positions, meta) -> torch.Tensor | None:
        intermediate = None
        if not self.pp.is_first:
            shape = (2, input_ids.shape[0], self.hidden_size)
            start = time.perf_counter()
            both = self.pp.recv(shape, self.dtype, self.device)
            self.wait_seconds += time.perf_counter() - start
            intermediate = IntermediateTensors(both[0], both[1])
        out = self.model(input_ids, positions, meta, intermediate=intermediate)
        if self.pp.is_last:
            return out
        self.wait_sent()
        both = torch.stack((out.hidden, out.residual))
        self._sending = (both, self.pp.send(both))
        return None

    def wait_sent(self) -> None:
        """Until the last batch sent has left (its buffer may go then)."""
        if self._sending is not None:
            start = time.perf_counter()
            self._sending[1].wait()
            self.wait_seconds += time.perf_counter() - start
            self._sending = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.model.compute_logits(hidden)

    def attention_layers(self) -> list:
        return self.model.attention_layers()

    def state_layers(self) -> list:
        return self.model.state_layers()


class PipelineStageStep(StepFeature):
    """The step of a stage that does not sample (see the module's docstring)."""

    def __init__(self, input_batch: InputBatch) -> None:
        self.input_batch = input_batch

    def prepare(self, step: RunnerStep) -> None:
        cached = step.so.scheduled_cached_reqs
        batch = self.input_batch
        for req_id, start, tokens in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_token_ids
        ):
            if not tokens:
                continue
            row = batch.req_id_to_row[req_id]
            end = start + len(tokens)
            batch.token_ids[row, start:end] = tokens
            batch.num_tokens[row] = max(int(batch.num_tokens[row]), end)

    def after_forward(self, step: RunnerStep) -> None:
        # Nothing to sample here; the last stage answers for the step.
        step.output = ModelRunnerOutput(step.req_ids, [[] for _ in step.req_ids])
