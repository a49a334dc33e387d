"""Drive the scheduler without a model: synthetic requests and hand-made runner outputs."""

from __future__ import annotations

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.request import Request
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from minivllm.core.scheduler import Scheduler
from minivllm.sampling_params import SamplingParams

EOS = 0


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, policy),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
    )


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params,
) -> Request:
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
        eos_token_id=EOS,
        arrival_time=arrival_time,
        priority=priority,
    )


def fake_runner_output(so: SchedulerOutput, sched: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """Sample `token` for every request whose scheduled tokens reach its end."""
    req_ids, sampled = [], []
    for req_id in so.num_scheduled_tokens:
        request = sched.requests[req_id]
        req_ids.append(req_id)
        sampled.append([token] if request.num_computed_tokens >= request.num_tokens else [])
    return ModelRunnerOutput(req_ids, sampled)


def step(sched: Scheduler, token: int = 7):
    so = sched.schedule()
    out = sched.update_from_output(so, fake_runner_output(so, sched, token))
    sched.check_invariants()
    return so, out
