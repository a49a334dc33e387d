"""The batch queue without a model: a pipelined fake executor keeps up to N steps in
flight, and every request gets the tokens a one-step-at-a-time engine gives it."""

from __future__ import annotations

import pytest

from minivllm.core.request import RequestStatus
from minivllm.core.sched_output import SchedulerOutput
from minivllm.engine.batch_queue import BatchQueue
from minivllm.executor.abstract import StepFuture
from tests.core.helpers import FakeModelRunner, make_request, make_scheduler, token_at

BS = 4


class PipelinedExecutor:
    """Stands for a pipeline of stages. The last stage is a FakeModelRunner (it samples and
    checks what attention would read), run when a step's output is asked for, oldest
    first, as the stages finish their batches in order. The first stage's view of each
    request is rebuilt from the schedules alone (new requests' tokens, then each step's
    new_token_ids), as a stage that does not sample keeps it: its inputs must be the
    tokens the last stage computes."""

    def __init__(self, block_size: int) -> None:
        self.runner = FakeModelRunner(block_size)
        self.first_stage: dict[str, list[int]] = {}
        self.in_flight: list[set[str]] = []
        self.most_in_flight = 0

    def execute_model(self, so: SchedulerOutput, non_block: bool = False) -> StepFuture:
        assert non_block
        scheduled = set(so.num_scheduled_tokens)
        for batch in self.in_flight:
            assert not scheduled & batch, f"{scheduled & batch} scheduled while in flight"
        for req_id in so.finished_req_ids:
            self.first_stage.pop(req_id, None)
        starts = {}
        for new in so.scheduled_new_reqs:
            self.first_stage[new.req_id] = list(new.token_ids)
            starts[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        assert len(cached.new_token_ids) == len(cached.req_ids)
        for req_id, start, tokens in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_token_ids
        ):
            known = self.first_stage[req_id]
            assert start <= len(known), f"{req_id}: a gap before position {start}"
            known[start : start + len(tokens)] = tokens
            starts[req_id] = start
        inputs = {
            req_id: self.first_stage[req_id][starts[req_id] : starts[req_id] + n]
            for req_id, n in so.num_scheduled_tokens.items()
        }
        for req_id, n in so.num_scheduled_tokens.items():
            assert len(inputs[req_id]) == n, f"{req_id}: the first stage lacks an input token"
        self.in_flight.append(scheduled)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))

        def finish():
            assert self.in_flight[0] is scheduled, "steps finish in launch order"
            self.in_flight.pop(0)
            output = self.runner.execute_model(so)
            for req_id, tokens in inputs.items():
                state = self.runner.states[req_id]
                start = starts[req_id]
                assert state.token_ids[start : start + len(tokens)] == tokens, req_id
            return output

        return StepFuture(finish)


def run(queue: BatchQueue, arrivals: dict[int, list] | None = None, abort_at=None):
    """Step until done; returns each request's tokens and finish reason. arrivals: step
    number -> requests added before it; abort_at: (step, request id) aborted before it."""
    sched = queue.scheduler
    tokens: dict[str, list[int]] = {}
    reasons = {}
    arrivals = dict(arrivals or {})
    n = 0
    while sched.has_unfinished_requests() or len(queue) or arrivals:
        for request in arrivals.pop(n, []):
            sched.add_request(request)
        if abort_at is not None and abort_at[0] == n:
            sched.finish_requests(abort_at[1], RequestStatus.FINISHED_ABORTED)
        for out in queue.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        sched.check_invariants()
        n += 1
        assert n < 2000, "the engine did not finish"
    return tokens, reasons


def expected(req_id: str, prompt_len: int, max_tokens: int) -> list[int]:
    return [token_at(req_id, prompt_len + i) for i in range(max_tokens)]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(
    "engine",
    [
        dict(num_blocks=64),
        dict(num_blocks=64, max_num_batched_tokens=6),  # chunked prefill
        dict(num_blocks=9, max_num_batched_tokens=16),  # preemption
    ],
    ids=["plain", "chunked", "preempted"],
)
def test_every_request_gets_its_tokens_with_steps_in_flight(size, engine):
    sched = make_scheduler(block_size=BS, **engine)
    executor = PipelinedExecutor(BS)
    queue = BatchQueue(sched, executor, size)
    prompts = {f"r{i}": list(range(10 * i + 1, 10 * i + 3 + 3 * i)) for i in range(6)}
    max_tokens = {req_id: 5 + 3 * i for i, req_id in enumerate(prompts)}
    requests = [make_request(r, p, max_tokens=max_tokens[r]) for r, p in prompts.items()]
    # Two now, the rest while the first are in flight; a shared prefix hits the cache.
    late = [*requests[2:], make_request("shared", prompts["r5"] + [99], max_tokens=4)]
    tokens, reasons = run(queue, {0: requests[:2], 3: late})
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == expected(req_id, len(prompt), max_tokens[req_id]), req_id
    assert tokens["shared"] == expected("shared", len(prompts["r5"]) + 1, 4)
    assert executor.most_in_flight == size
    assert not sched.in_flight and not executor.in_flight
    assert sched.kv_cache_manager.get_num_free_blocks() == engine["num_blocks"]
    if engine["num_blocks"] == 9:
        assert sched.num_preemptions > 0


def test_a_request_aborted_in_flight_leaves_the_others_whole():
    sched = make_scheduler(num_blocks=32, block_size=BS)
    executor = PipelinedExecutor(BS)
    queue = BatchQueue(sched, executor, 2)
    requests = [make_request(f"r{i}", [i + 1] * (3 + i), max_tokens=12) for i in range(4)]
    tokens, _ = run(queue, {0: requests}, abort_at=(4, "r1"))
    assert "r1" not in executor.runner.states
    for i in (0, 2, 3):
        assert tokens[f"r{i}"] == expected(f"r{i}", 3 + i, 12)
    assert len(tokens.get("r1", [])) < 12
    assert sched.kv_cache_manager.get_num_free_blocks() == 32


def test_one_batch_at_a_time_when_nothing_else_can_run():
    """A single request: each step waits for the one in flight (nothing else to run)."""
    sched = make_scheduler(num_blocks=16, block_size=BS)
    executor = PipelinedExecutor(BS)
    queue = BatchQueue(sched, executor, 2)
    tokens, _ = run(queue, {0: [make_request("only", [1, 2, 3], max_tokens=6)]})
    assert tokens["only"] == expected("only", 3, 6)
    assert executor.most_in_flight == 1
