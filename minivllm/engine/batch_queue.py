"""Seed 001's batch queue: up to ``max_concurrent_batches`` steps in flight at once, so that
with pipeline parallelism every stage works on a batch while the others work on theirs
(no pipeline bubbles).

``step`` launches batches while the queue has room and the scheduler finds work that is
not in flight (``Scheduler.in_flight``: a request is never scheduled again, nor preempted,
until its step's output is in; a step takes at most 1/size of the running requests, so the
next stage's batch is not empty), then waits for the oldest batch and updates the scheduler
from its output. Each stage runs the batches in launch order, so a later batch reads the
K/V an earlier one wrote, and blocks freed while a batch is in flight are written by it
before a later batch that reuses them.
"""

from __future__ import annotations

from collections import deque

from minivllm.core.sched_output import SchedulerOutput
from minivllm.core.scheduler import Scheduler
from minivllm.engine.messages import EngineCoreOutputs
from minivllm.executor.abstract import Executor, StepFuture


class BatchQueue:
    def __init__(self, scheduler: Scheduler, executor: Executor, size: int) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.size = size
        self.batches: deque[tuple[SchedulerOutput, StepFuture]] = deque()
        scheduler.in_flight = set()
        scheduler.max_concurrent_batches = size

    def __len__(self) -> int:
        return len(self.batches)

    def step(self) -> EngineCoreOutputs:
        """Fill the queue, then the oldest batch's outputs (the scheduler's statistics
        alone when nothing ran). The queue is filled again before those outputs go back:
        the requests of the batch just in are free to run, and the first stage, done with
        the batches it had, would otherwise wait while the outputs are processed and sent
        (with the engine core in the frontend's process, while the frontend detokenizes)."""
        scheduler = self.scheduler
        self._fill()
        if not self.batches:
            return EngineCoreOutputs(scheduler_stats=scheduler.make_stats())
        so, future = self.batches.popleft()
        outputs = scheduler.update_from_output(so, future.result())
        self._fill()
        return outputs

    def _fill(self) -> None:
        """Launch batches while the queue has room and the scheduler finds work that is
        not in flight."""
        scheduler = self.scheduler
        while len(self.batches) < self.size and scheduler.has_unfinished_requests():
            so = scheduler.schedule()
            if not so.total_num_scheduled_tokens and self.batches and not _carries_news(so):
                break  # everything that can run is in flight
            add_new_token_ids(so, scheduler)
            self.batches.append((so, self.executor.execute_model(so, non_block=True)))
            if not so.total_num_scheduled_tokens:
                break


def _carries_news(so: SchedulerOutput) -> bool:
    """Whether a step without tokens still tells the workers something (requests to
    forget, disk blocks to move): it goes to them like any step."""
    return bool(so.finished_req_ids) or so.kv_transfers is not None


def add_new_token_ids(so: SchedulerOutput, scheduler: Scheduler) -> None:
    """Each running request's tokens of this step (``CachedRequestData.new_token_ids``):
    the stages that do not sample take the ones sampled since its last step from them."""
    cached = so.scheduled_cached_reqs
    requests = scheduler.requests
    num_scheduled = so.num_scheduled_tokens
    cached.new_token_ids = [
        requests[req_id].all_token_ids[start : start + num_scheduled[req_id]]
        for req_id, start in zip(cached.req_ids, cached.num_computed_tokens)
    ]
