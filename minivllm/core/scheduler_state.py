"""What a scheduler's state says of itself: the stats each step's outputs carry to the
frontend's loggers and metrics, and the invariants that tests assert after every step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.core.request import RequestStatus
from minivllm.engine.messages import SchedulerStats

if TYPE_CHECKING:
    from minivllm.core.scheduler import Scheduler


def make_scheduler_stats(scheduler: Scheduler) -> SchedulerStats:
    kv = scheduler.kv_cache_manager
    running, waiting = {}, {}
    if scheduler.max_loras is not None:
        for queue, counts in ((scheduler.running, running), (scheduler.waiting, waiting)):
            for request in queue:
                if request.lora_request is not None:
                    name = request.lora_request.lora_name
                    counts[name] = counts.get(name, 0) + 1
    return SchedulerStats(
        num_running_reqs=len(scheduler.running),
        num_waiting_reqs=len(scheduler.waiting),
        kv_cache_usage=kv.usage,
        num_free_blocks=kv.get_num_free_blocks(),
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        **kv.disk_stats(),
        num_preemptions=scheduler.num_preemptions,
        spec_decode_num_drafts=scheduler.num_drafts,
        spec_decode_num_draft_tokens=scheduler.num_draft_tokens,
        spec_decode_num_accepted_tokens=scheduler.num_accepted_tokens,
        running_lora_adapters=running,
        waiting_lora_adapters=waiting,
        slo_step_time_model=slo_coefficients(scheduler),
    )


def slo_coefficients(scheduler: Scheduler) -> list[float]:
    """The slo policy's step-time coefficients, once fitted (else none)."""
    model = getattr(scheduler.policy, "model", None)
    if model is None or not model.fitted:
        return []
    return [float(c) for c in model.coefficients]


def check_scheduler_invariants(scheduler: Scheduler) -> None:
    """Raise AssertionError if the queues or the KV cache bookkeeping are inconsistent.

    Cheap enough (linear in blocks and requests) to call after every step in tests.
    """
    kv = scheduler.kv_cache_manager
    kv.check_invariants()
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    assert len(set(running_ids)) == len(running_ids), "a request runs twice"
    assert not set(running_ids) & set(waiting_ids), "a request both runs and waits"
    assert set(running_ids) | set(waiting_ids) == set(scheduler.requests), (
        "the request table disagrees with the queues"
    )
    assert len(scheduler.running) <= scheduler.config.max_num_seqs, "more running than max_num_seqs"
    constrained = [
        r for r in scheduler.requests.values() if r.structured_output_request is not None
    ]
    assert scheduler.num_constrained == len(constrained), "the count of grammars is off"
    assert set(kv.req_to_blocks) <= set(running_ids), "a non-running request holds blocks"
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING, f"{request} in running"
        held = len(kv.get_block_ids(request.request_id))
        need = -(-request.num_computed_tokens // kv.block_size)
        assert held >= need, (
            f"{request} computed {request.num_computed_tokens} tokens in {held} blocks"
        )
    for request in scheduler.waiting:
        assert request.status in (
            RequestStatus.WAITING,
            RequestStatus.WAITING_FOR_FSM,
            RequestStatus.PREEMPTED,
        ), f"{request} in waiting"
        assert request.num_computed_tokens == 0, f"{request} waits with computed tokens"
