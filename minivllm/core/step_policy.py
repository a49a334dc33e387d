"""How a step is composed beyond the token budget, and whom to preempt: the scheduler's policy.

The scheduler owns the bookkeeping (queues, KV blocks, counters); a policy only answers
its questions. The default serves fcfs and priority: every request takes what the token
budget gives it, and the victim is the newest (fcfs) or the lowest-priority request.
core/slo_policy.py's SLOPolicy composes steps to the requests' latency targets.
"""

from __future__ import annotations

from minivllm.config import SchedulerConfig
from minivllm.core.request import Request
from minivllm.core.request_queue import create_request_queue
from minivllm.core.sched_output import SchedulerOutput


class StepPolicy:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def make_waiting_queue(self):
        return create_request_queue(self.config.policy)

    def check_admission(self, request: Request) -> None:
        """Raise ValueError (saying why) for a request the engine should refuse outright."""

    def begin_step(self, running: list[Request], waiting) -> None:
        """A step starts: the policy may reorder `running` (the order it is served in)."""

    def fit(self, request: Request, num_new: int, num_computed: int) -> int:
        """How many of its num_new tokens (after num_computed) the request gets this step;
        0: none (a running request sits the step out; a waiting one stops admission)."""
        return num_new

    def commit(self, request: Request, num_new: int, num_computed: int) -> None:
        """The request was scheduled num_new tokens after num_computed."""

    def release(self, request: Request, num_new: int, num_computed: int) -> None:
        """A request scheduled this step was preempted: its tokens are given back."""

    def pick_victim(self, running: list[Request]) -> Request:
        if self.config.policy == "priority":
            return max(running, key=lambda r: (r.priority, r.arrival_time))
        return running[-1]  # FCFS: the newest

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """A scheduled step took this long (schedule to outputs)."""


def make_step_policy(config: SchedulerConfig) -> StepPolicy:
    if config.policy == "slo":
        from minivllm.core.slo_policy import SLOPolicy

        return SLOPolicy(config)
    return StepPolicy(config)
