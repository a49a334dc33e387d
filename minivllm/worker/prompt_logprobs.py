"""Prompt logprobs: the logprob of each prompt token given what precedes it, for the
requests that ask (``SamplingParams.prompt_logprobs``)."""

from __future__ import annotations

import torch

from minivllm.core.sched_output import SchedulerOutput
from minivllm.sample.sampler import gather_logprobs
from minivllm.worker.step import CachedRequestState, RunnerStep, StepFeature


class PromptLogprobs(StepFeature):
    """A prompt computed in chunks collects them chunk by chunk (on the request's state);
    the whole list is sent once the prompt is done: (ids [P-1][1+k], logprobs [P-1][1+k],
    ranks [P-1])."""

    def __init__(
        self, model: torch.nn.Module, vocab_size: int, requests: dict[str, CachedRequestState]
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.requests = requests
        # The requests whose prompt logprobs are still being collected.
        self.reqs: set[str] = set()

    def update_states(self, so: SchedulerOutput) -> None:
        if self.reqs and so.finished_req_ids:
            self.reqs.difference_update(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            if new.sampling_params.prompt_logprobs is not None:
                self.reqs.add(new.req_id)

    def prepare(self, step: RunnerStep) -> None:
        if self.reqs and not self.reqs.isdisjoint(step.req_ids):
            step.reads_all_rows = True  # every row of theirs gives logits

    def after_forward(self, step: RunnerStep) -> None:
        if step.reads_all_rows and self.reqs:
            step.prompt_logprobs = self._collect(step)

    def _rows(self, step: RunnerStep) -> list[tuple[CachedRequestState, list[int], list[int]]]:
        """(state, batch rows, target token ids) of the requests collecting prompt logprobs:
        position p predicts prompt token p + 1."""
        found = []
        inputs = step.inputs
        starts = inputs.query_start_loc_cpu.tolist()
        for i, req_id in enumerate(step.req_ids):
            if req_id not in self.reqs:
                continue
            state = self.requests[req_id]
            start = int(inputs.positions_cpu[starts[i]])  # tokens computed before this step
            end = start + int(inputs.num_scheduled[i])
            last = min(end, state.num_prompt_tokens - 1)
            first = max(start, len(state.prompt_logprobs[2]))
            rows = list(range(starts[i] + first - start, starts[i] + last - start))
            targets = state.token_ids[first + 1 : last + 1]
            found.append((state, rows, targets))
        return found

    def _collect(self, step: RunnerStep) -> dict[str, tuple]:
        """This step's rows of each collecting request; the lists of those now done."""
        finished = {}
        hidden = step.hidden
        for state, rows, targets in self._rows(step):
            k = state.sampling_params.prompt_logprobs
            k = self.vocab_size if k == -1 else k
            if rows:
                logits = self.model.compute_logits(hidden[rows])
                if logits is None:  # not rank 0: only the count matters here
                    state.prompt_logprobs[2].extend([0] * len(rows))
                else:
                    logprobs = torch.log_softmax(logits, dim=-1)
                    targets = torch.tensor(targets, device=logprobs.device)
                    ids, values, ranks = gather_logprobs(logprobs, targets, k)
                    state.prompt_logprobs[0].extend(ids.tolist())
                    state.prompt_logprobs[1].extend(values.tolist())
                    state.prompt_logprobs[2].extend(ranks.tolist())
            if len(state.prompt_logprobs[2]) == state.num_prompt_tokens - 1:
                finished[state.req_id] = tuple(state.prompt_logprobs)
                self.reqs.discard(state.req_id)
        return finished
