"""The `slo` policy's choices, driven without a model: a step-time model with known
coefficients, a clock the test moves, hand-made runner outputs."""

from __future__ import annotations

import random

import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.scheduler import Scheduler
from minivllm.core.slo_policy import (
    STALE_MODEL_S,
    TPOT_AIM,
    TTFT_AIM,
    SLOAdmission,
    SLOPolicy,
    SLORequestQueue,
    targets_of,
)
from minivllm.core.step_time_model import StepShape, StepTimeModel
from minivllm.sampling_params import SamplingParams
from minivllm.slo_params import SLOParams
from tests.core.helpers import FakeEngine, make_request, make_scheduler, step

# 10 ms a step + 0.5 ms a prompt token + 1.5 ms a decode row (+ nothing for a step with
# prompts, nor attention): a decode of one request alone takes 11.5 ms, a 64-token prompt
# alone 42 ms.
COEFFICIENTS = [0.010, 0.0, 0.0005, 0.0015, 0.0]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def slo_scheduler(
    clock: Clock,
    max_num_batched_tokens: int = 256,
    num_blocks: int = 256,
    default_tpot: float | None = None,
    default_ttft: float | None = None,
    max_num_seqs: int = 16,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=1024,
        policy="slo",
        default_slo_tpot=default_tpot,
        default_slo_ttft=default_ttft,
    )
    sched = Scheduler(config, CacheConfig(block_size=4), num_blocks)
    model = StepTimeModel()
    model.load(COEFFICIENTS)
    sched.policy = SLOPolicy(config, model, clock)
    sched.waiting = sched.policy.make_waiting_queue()
    return sched


def prompt_of(req_id: str, length: int) -> list[int]:
    """A prompt no other request shares a block of (no prefix-cache hits in these tests)."""
    rng = random.Random(req_id)
    return [rng.randint(1, 10_000) for _ in range(length)]


def urgent(req_id, prompt_len, tpot=None, ttft=None, max_tokens=8, arrival=1000.0):
    return make_request(
        req_id,
        prompt_of(req_id, prompt_len),
        max_tokens=max_tokens,
        arrival_time=arrival,
        slo_params=SLOParams(True, tpot, ttft),
    )


def best_effort(req_id, prompt_len, max_tokens=8, arrival=1000.0):
    return make_request(
        req_id, prompt_of(req_id, prompt_len), max_tokens=max_tokens, arrival_time=arrival
    )


def test_best_effort_prompt_is_chunked_to_the_decodes_target():
    clock = Clock()
    sched = slo_scheduler(clock)
    sched.add_request(urgent("chat", 8, tpot=0.051))
    step(sched)  # its prompt: its first token
    sched.add_request(best_effort("batch", 200))
    so, _ = step(sched)
    # The next token is due 0.9 * 51 ms after the first (TPOT_AIM); the step may take 0.85
    # of that, 39.0 ms: 10 + 1.5 (the decode) + 0.5 ms per token -> 55 tokens.
    assert TPOT_AIM == 0.9
    assert so.num_scheduled_tokens == {"chat": 1, "batch": 55}
    assert sched.policy.predicted_time() <= 0.85 * TPOT_AIM * 0.051


def test_without_latency_sensitive_requests_best_effort_takes_the_whole_budget():
    sched = slo_scheduler(Clock())
    sched.add_request(best_effort("a", 200))
    sched.add_request(best_effort("b", 200))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 200, "b": 56}


def test_late_decode_leaves_no_room_for_best_effort_but_still_runs():
    clock = Clock()
    sched = slo_scheduler(clock)
    sched.add_request(urgent("chat", 8, tpot=0.02))
    sched.add_request(best_effort("batch", 8, max_tokens=20))
    step(sched)  # both prompts
    step(sched)  # chat's first token is seen, and its second computed
    clock.now += 0.5  # far behind its deadline
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"chat": 1}  # the best-effort decode sits it out
    clock.now += 0.001
    so, _ = step(sched)
    assert "chat" in so.num_scheduled_tokens


def test_slack_ahead_of_the_deadline_is_lent_to_best_effort_up_to_a_cap():
    clock = Clock()
    sched = slo_scheduler(clock, max_num_batched_tokens=1024)
    sched.add_request(urgent("chat", 8, tpot=0.05, max_tokens=100))
    step(sched)
    for _ in range(10):  # ten decodes, each taking no time: 10 targets ahead
        step(sched)
    sched.add_request(best_effort("batch", 1000))
    so, _ = step(sched)
    limit = 0.85 * 3 * 0.05  # at most three targets' time in one step
    n = so.num_scheduled_tokens["batch"]
    assert 0 < n < 1000
    with_one_more = StepShape()
    with_one_more.add(1, 18)
    with_one_more.add(n + 1, 0)
    assert sched.policy.predicted_time() <= limit
    assert sched.policy.model.predict(with_one_more) > limit


def test_waiting_latency_sensitive_request_goes_before_earlier_best_effort_ones():
    clock = Clock()
    sched = slo_scheduler(clock, max_num_batched_tokens=64)
    sched.add_request(best_effort("batch", 60, arrival=999.0))
    sched.add_request(urgent("chat", 30, ttft=1.0))
    so, _ = step(sched)
    assert so.num_scheduled_tokens["chat"] == 30
    assert so.num_scheduled_tokens.get("batch", 0) == 34


def test_running_best_effort_prompt_leaves_room_for_a_waiting_chat():
    clock = Clock()
    sched = slo_scheduler(clock, max_num_batched_tokens=64)
    sched.add_request(best_effort("batch", 600))
    step(sched)  # its first chunk: it is running
    sched.add_request(urgent("chat", 40, ttft=1.0))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"batch": 24, "chat": 40}


def test_best_effort_work_ends_before_a_waiting_chats_planned_ttft():
    clock = Clock()
    sched = slo_scheduler(clock, max_num_batched_tokens=256)
    sched.add_request(best_effort("batch", 900))
    step(sched)  # its first chunk: it is running
    sched.add_request(urgent("chat", 40, ttft=1.0))
    clock.now += 0.8  # the chat's first token is planned 0.9 s after arrival (TTFT_AIM)
    so, _ = step(sched)
    # 0.85 * (0.9 - 0.8) s = 85 ms: 10 ms a step and 0.5 ms a prompt token make 150 tokens,
    # of which the chat takes 40. Planned on the target itself (0.2 s of room) the batch's
    # chunk would fill the step's 256 tokens.
    assert TTFT_AIM == 0.9
    assert so.num_scheduled_tokens == {"chat": 40, "batch": 110}


def test_chat_prompt_is_chunked_no_smaller_than_its_minimum_when_time_is_short():
    clock = Clock()
    sched = slo_scheduler(clock, max_num_batched_tokens=512)
    sched.add_request(urgent("a", 8, tpot=0.015, max_tokens=50))
    step(sched)
    sched.add_request(urgent("b", 300, ttft=5.0))
    so, _ = step(sched)
    # 0.85 * 15 ms leaves room for 2 tokens beside a's decode (11.5 ms): b gets 16 anyway.
    assert so.num_scheduled_tokens == {"a": 1, "b": 16}


def test_best_effort_is_preempted_first():
    clock = Clock()
    # 12 blocks of 4 tokens: three requests of 16 tokens fill the pool.
    sched = slo_scheduler(clock, num_blocks=12)
    sched.add_request(urgent("chat", 14, tpot=1.0, max_tokens=30, arrival=1000.0))
    sched.add_request(best_effort("old", 14, max_tokens=30, arrival=999.0))
    sched.add_request(best_effort("new", 14, max_tokens=30, arrival=999.5))
    preempted = []
    for _ in range(12):
        so, _ = step(sched)
        preempted += so.preempted_req_ids
    assert preempted and preempted[0] == "new"
    assert "chat" not in preempted


def test_admission_refuses_what_cannot_be_met_alone():
    sched = slo_scheduler(Clock())
    with pytest.raises(ValueError, match="TPOT target"):
        sched.add_request(urgent("tight", 8, tpot=0.005))  # one decode takes 11.5 ms
    with pytest.raises(ValueError, match="TTFT target"):
        sched.add_request(urgent("long", 200, ttft=0.05))  # its prompt takes 111 ms
    assert not sched.requests
    sched.add_request(urgent("fine", 8, tpot=0.05, ttft=1.0))
    sched.add_request(best_effort("batch", 1000))  # best-effort requests always queue
    assert set(sched.requests) == {"fine", "batch"}


def test_a_model_no_step_has_confirmed_for_a_while_refuses_nothing():
    clock = Clock()
    sched = slo_scheduler(clock)
    with pytest.raises(ValueError, match="TPOT target"):
        sched.add_request(urgent("tight", 8, tpot=0.005))
    # No step for a while (nothing else ran: only steps could correct the model)
    clock.now += STALE_MODEL_S + 1
    sched.add_request(urgent("probe", 8, tpot=0.005))
    assert "probe" in sched.requests
    output, _ = step(sched)
    sched.policy.observe_step(output, 0.0115)  # a step confirms the model: it refuses again
    with pytest.raises(ValueError, match="TPOT target"):
        sched.add_request(urgent("tight", 8, tpot=0.005))


def test_the_frontends_admission_refuses_nothing_on_a_model_no_step_confirmed():
    clock = Clock()
    admission = SLOAdmission(SchedulerConfig(policy="slo"), COEFFICIENTS, clock)
    tight = SamplingParams(max_tokens=4, slo_params=SLOParams(True, tpot=0.005))
    with pytest.raises(ValueError, match="TPOT target"):
        admission.check(8, tight)
    clock.now += STALE_MODEL_S + 1
    admission.check(8, tight)  # no step's coefficients for a while: it goes to the core
    admission.update(COEFFICIENTS)  # a step's
    with pytest.raises(ValueError, match="TPOT target"):
        admission.check(8, tight)


def test_defaults_fill_unset_targets():
    sched = slo_scheduler(Clock(), default_tpot=0.05, default_ttft=2.0)
    request = urgent("chat", 8)
    assert targets_of(request, sched.config) == SLOParams(True, 0.05, 2.0)
    assert targets_of(best_effort("b", 8), sched.config) == SLOParams()
    given = urgent("own", 8, tpot=0.1)
    assert targets_of(given, sched.config) == SLOParams(True, 0.1, 2.0)


def test_queue_orders_chats_by_deadline_then_best_effort_by_arrival():
    config = SchedulerConfig(policy="slo")
    queue = SLORequestQueue(lambda r: targets_of(r, config))
    queue.add_request(best_effort("b1", 4, arrival=1.0))
    queue.add_request(urgent("late", 4, ttft=5.0, arrival=2.0))
    queue.add_request(best_effort("b2", 4, arrival=3.0))
    queue.add_request(urgent("soon", 4, ttft=1.0, arrival=4.0))
    queue.prepend_request(best_effort("b0", 4, arrival=5.0))  # preempted: its class's front
    assert [r.request_id for r in queue] == ["soon", "late", "b0", "b1", "b2"]
    order = []
    while queue:
        order.append(queue.pop_request().request_id)
    assert order == ["soon", "late", "b0", "b1", "b2"]


def test_step_time_model_recovers_its_coefficients():
    rng = random.Random(0)
    model = StepTimeModel()
    truth = [0.012, 0.004, 0.0004, 0.003, 0.00002]
    for _ in range(200):
        shape = StepShape()
        for _ in range(rng.randint(1, 12)):
            shape.add(rng.choice([1, 1, 1, rng.randint(2, 400)]), rng.randint(0, 800))
        seconds = float(sum(c * x for c, x in zip(truth, shape.features())))
        model.observe(shape, seconds * (1 + rng.uniform(-0.03, 0.03)))
    assert model.median_error() < 0.05
    assert model.coefficients == pytest.approx(truth, rel=0.2)
    assert (model.coefficients >= 0).all()


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_give_every_request_the_tokens_fcfs_gives(seed):
    """Same workload under fcfs and slo (random arrivals, classes, targets, a small KV pool):
    every request finishes with the same tokens, and every invariant holds on the way."""
    results, schedules = {}, {}
    for policy in ("fcfs", "slo"):
        rng = random.Random(seed)
        clock = Clock()
        if policy == "slo":
            sched = slo_scheduler(clock, max_num_batched_tokens=32, num_blocks=40, max_num_seqs=6)
        else:
            sched = make_scheduler(
                num_blocks=40, max_num_batched_tokens=32, max_num_seqs=6, policy="fcfs"
            )
        eng = FakeEngine(sched)
        schedules[policy] = trace = []
        wanted = {}
        for step_no in range(300):
            clock.now += rng.uniform(0.0, 0.06)
            if step_no < 200 and rng.random() < 0.3:
                req_id = f"r{len(wanted)}"
                prompt = [rng.randint(1, 50) for _ in range(rng.randint(1, 60))]
                max_tokens = rng.randint(1, 24)
                slo = (
                    SLOParams(True, rng.choice([0.02, 0.05, None]), rng.choice([0.5, None]))
                    if rng.random() < 0.3
                    else None
                )
                eng.add(
                    make_request(
                        req_id,
                        prompt,
                        max_tokens=max_tokens,
                        arrival_time=clock.now,
                        slo_params=slo,
                    )
                )
                wanted[req_id] = max_tokens
            if eng.busy():
                trace.append(eng.step().num_scheduled_tokens)
        eng.run()
        assert sched.kv_cache_manager.get_num_free_blocks() == 40
        for req_id, max_tokens in wanted.items():
            assert len(eng.result(req_id)[0]) == max_tokens
        results[policy] = {r: eng.result(r) for r in wanted}
    assert results["slo"] == results["fcfs"]
    assert schedules["slo"] != schedules["fcfs"]  # the policy did choose differently


def test_a_late_chat_prompt_is_not_held_back_by_its_own_deadline():
    clock = Clock()
    sched = slo_scheduler(clock, max_num_batched_tokens=256)
    sched.add_request(best_effort("batch", 100, max_tokens=50))
    step(sched)
    sched.add_request(urgent("chat", 200, ttft=1.0))
    clock.now += 5.0  # its TTFT is already missed
    so, _ = step(sched)
    # No decode has a TPOT to keep: the chat's whole prompt runs; best-effort work, which
    # would only delay it further, gets nothing beyond what the step's first request gets.
    assert so.num_scheduled_tokens["chat"] == 200
    assert so.num_scheduled_tokens.get("batch", 0) <= 16
