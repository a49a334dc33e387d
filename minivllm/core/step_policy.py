"""How a step is composed beyond the token budget, and whom to preempt: the scheduler's policy.

The scheduler owns the bookkeeping (queues, KV blocks, counters); a policy only answers
its questions. The default serves fcfs and priority: every request takes what the token
budget and its group's fair share (core/fair_share.py: the n sequences of one request take
no more than a fair share of a step while others have work) give it, and the victim is the
newest (fcfs) or the lowest-priority request. core/slo_policy.py's SLOPolicy composes steps
to the requests' latency targets within the same fair shares.
"""

from __future__ import annotations

from minivllm.config import SchedulerConfig
from minivllm.core.fair_share import FairShare
from minivllm.core.request import Request
from minivllm.core.request_queue import create_request_queue
from minivllm.core.sched_output import SchedulerOutput


class StepPolicy:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.fair_share = FairShare(config.max_num_batched_tokens, config.max_num_seqs)

    def make_waiting_queue(self):
        return create_request_queue(self.config.policy)

    def check_admission(self, request: Request) -> None:
        """Raise ValueError (saying why) for a request the engine should refuse outright."""

    def request_added(self, request: Request) -> None:
        """The scheduler took the request in (after check_admission)."""
        self.fair_share.request_added(request)

    def request_freed(self, request: Request) -> None:
        """The request finished (or was aborted) and left the scheduler."""
        self.fair_share.request_freed(request)

    def begin_step(self, running: list[Request], waiting) -> None:
        """A step starts: the policy may reorder `running` (the order it is served in)."""
        self.fair_share.begin_step(running, waiting)

    def defers(self, request: Request) -> bool:
        """Whether a waiting request sits this step out, keeping its place, while the ones
        behind it may start (its group has had its share of the step)."""
        return self.fair_share.defers(request, self.config.enable_chunked_prefill)

    def fit(self, request: Request, num_new: int, num_computed: int) -> int:
        """How many of its num_new tokens (after num_computed) the request gets this step;
        0: none (a running request sits the step out; a waiting one stops admission)."""
        return self.fair_share.fit(request, num_new)

    def shapes_step(self) -> bool:
        """Whether this step's fit may cut a request's tokens (or commit record them): if
        not, the scheduler asks neither for each request (at 256 running requests the two
        calls were a fifth of a decode step's scheduling)."""
        return self.fair_share.caps_any()

    def commit(self, request: Request, num_new: int, num_computed: int) -> None:
        """The request was scheduled num_new tokens after num_computed (called before a
        waiting request's status becomes RUNNING)."""
        self.fair_share.commit(request, num_new)

    def release(self, request: Request, num_new: int, num_computed: int) -> None:
        """A request scheduled this step was preempted: its tokens are given back."""
        self.fair_share.release(request, num_new)

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
