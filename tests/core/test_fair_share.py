"""Fair shares of a step (core/fair_share.py), driven without a model: the n sequences of
one request cannot keep a newcomer out of the next step, a lone request still fills the
step, and separate requests keep their arrival order."""

from __future__ import annotations

import random

import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.fair_share import group_of, max_min_shares
from minivllm.core.scheduler import Scheduler
from minivllm.core.slo_policy import SLOPolicy
from minivllm.core.step_time_model import StepTimeModel
from minivllm.engine.messages import EngineCoreRequest
from minivllm.engine.parallel_sampling import fan_out
from minivllm.sampling_params import SamplingParams
from minivllm.slo_params import SLOParams
from tests.core.helpers import FakeEngine, make_request, make_scheduler, step

BUDGET, SEQS = 2048, 256  # the engine's defaults


@pytest.fixture(params=["fair", "off"])
def fairness(request, monkeypatch):
    """Each test that takes it runs with the rule and without, and asserts the difference
    (so the rule, not the scenario, is what the test sees)."""
    monkeypatch.setenv("MINIVLLM_FAIR_SHARE", "1" if request.param == "fair" else "0")
    return request.param == "fair"


def prompt_of(req_id: str, length: int) -> list[int]:
    rng = random.Random(req_id)
    return [rng.randint(1, 10_000) for _ in range(length)]


def add_parent(sched, parent: str, n: int, prompt: list[int], max_tokens: int = 16) -> list[str]:
    """The n children of one request, named as the frontend names them."""
    ids = [f"{i}_{parent}" for i in range(n)]
    for child in ids:
        sched.add_request(make_request(child, prompt, max_tokens=max_tokens))
    return ids


def group_tokens(so, parent: str) -> int:
    return sum(n for r, n in so.num_scheduled_tokens.items() if group_of(r) == parent)


def test_group_of_reads_the_frontends_child_ids():
    params = SamplingParams(n=3, max_tokens=4)
    request = EngineCoreRequest("cmpl-abc-0-1234abcd", [1, 2], params, None, 0.0)
    _, children = fan_out(request)
    assert [group_of(c.request_id) for c in children] == ["cmpl-abc-0-1234abcd"] * 3
    assert group_of("cmpl-abc-0-1234abcd") == "cmpl-abc-0-1234abcd"
    assert group_of("12") == "12"  # LLM.generate's ids


def test_max_min_shares_give_small_demands_theirs_and_split_the_rest():
    assert max_min_shares({"q": 5, "p": 9000, "r": 9000}, 2048) == {"q": 5, "p": 1021, "r": 1022}
    assert max_min_shares({"q": 5, "p": 100}, 2048) == {"q": 5, "p": 100}  # all fits
    assert sorted(set(max_min_shares({str(i): 1000 for i in range(7)}, 2048).values())) == [
        292,
        293,
    ]  # 2,048 over 7, the whole budget handed out


def test_a_newcomer_starts_in_the_next_step_beside_a_parent_of_128_long_prompts(fairness):
    # Without prefix caching every child computes its whole 100-token prompt: 12,800 tokens,
    # over six steps' budget.
    sched = make_scheduler(
        num_blocks=1024, block_size=16, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS,
        enable_prefix_caching=False,
    )  # fmt: skip
    add_parent(sched, "p", 128, prompt_of("p", 100))
    so, _ = step(sched)
    assert so.total_num_scheduled_tokens == BUDGET  # alone, the parent fills the step
    sched.add_request(make_request("q", [1, 2, 3, 4, 5], max_tokens=4))
    so, _ = step(sched)
    if fairness:
        assert so.num_scheduled_tokens["q"] == 5
        # The bound: the parent's max-min share, the budget less the newcomer's 5 tokens.
        assert group_tokens(so, "p") <= BUDGET - 5
        assert so.total_num_scheduled_tokens == BUDGET  # nothing of the step is wasted
    else:
        assert "q" not in so.num_scheduled_tokens  # behind 107 children's prompts


def test_a_newcomer_gets_a_sequence_slot_beside_a_parent_of_128(fairness):
    sched = make_scheduler(num_blocks=1024, max_num_batched_tokens=BUDGET, max_num_seqs=16)
    add_parent(sched, "p", 128, [1, 2, 3])
    sched.add_request(make_request("q", [4, 5, 6], max_tokens=4))
    so, _ = step(sched)
    if fairness:
        assert "q" in so.num_scheduled_tokens
        assert sum(group_of(r) == "p" for r in so.num_scheduled_tokens) == 15  # 16 less 1
    else:
        assert "q" not in so.num_scheduled_tokens  # 16 children hold every slot


def test_a_lone_parent_fills_the_step_and_the_slots(fairness):
    sched = make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=BUDGET,
                           max_num_seqs=SEQS, enable_prefix_caching=False)  # fmt: skip
    add_parent(sched, "p", 128, prompt_of("p", 100))
    for _ in range(6):
        assert step(sched)[0].total_num_scheduled_tokens == BUDGET
    sched = make_scheduler(num_blocks=4096, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS)
    add_parent(sched, "p", 300, [1, 2])
    so, _ = step(sched)
    assert len(so.num_scheduled_tokens) == SEQS  # every slot


def test_a_burst_of_32_requests_lets_a_newcomer_start_in_the_next_step(fairness):
    # issue 47's logit_bias load: 32 separate requests of a short prompt and 200 tokens.
    sched = make_scheduler(num_blocks=1024, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS)
    for i in range(32):
        sched.add_request(make_request(f"b{i}", [1, 2, 3, i + 10], max_tokens=200))
    for _ in range(3):
        step(sched)
    sched.add_request(make_request("q", [4, 5, 6, 7, 8], max_tokens=4))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"q": 5}  # its prompt alone (MINIVLLM_PREFILL_FIRST)


def test_the_issues_prompts_x_n_load_caps_nothing_and_the_newcomer_runs_next(fairness):
    # 4 short prompts x n=32 decoding need 128 of 2,048 tokens and 128 of 256 slots: no share
    # binds, and the newcomer's prompt has the next step to itself. What it waits for on a
    # server is the step in flight when it arrives (128 decode rows), which no share shortens.
    sched = make_scheduler(num_blocks=1024, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS)
    for k in range(4):
        add_parent(sched, f"p{k}", 32, [1, 2, k + 3])
    step(sched)
    sched.add_request(make_request("q", [4, 5, 6, 7, 8], max_tokens=4))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"q": 5}
    so, _ = step(sched)
    assert len(so.num_scheduled_tokens) == 129  # every sequence, the newcomer's decode too


def test_separate_long_prompts_keep_their_arrival_order(fairness):
    # A burst of separate requests is served first come first served, not in shares (which
    # would give each of them its first token only at the burst's end).
    sched = make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=BUDGET,
                           max_num_seqs=SEQS, enable_prefix_caching=False)  # fmt: skip
    for i in range(32):
        sched.add_request(make_request(f"b{i}", prompt_of(f"b{i}", 500), max_tokens=8))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"b0": 500, "b1": 500, "b2": 500, "b3": 500, "b4": 48}


def test_parents_share_the_step_evenly_and_the_newcomer_still_starts(fairness):
    sched = make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=BUDGET,
                           max_num_seqs=SEQS, enable_prefix_caching=False)  # fmt: skip
    add_parent(sched, "a", 64, prompt_of("a", 100))
    add_parent(sched, "b", 64, prompt_of("b", 100))
    sched.add_request(make_request("q", [1, 2, 3], max_tokens=4))
    so, _ = step(sched)
    if fairness:
        assert so.num_scheduled_tokens["q"] == 3
        assert sorted([group_tokens(so, "a"), group_tokens(so, "b")]) == [1022, 1023]
    else:
        assert group_tokens(so, "a") == BUDGET and "q" not in so.num_scheduled_tokens


def run_mix(num_blocks: int, prefix_caching: bool):
    """Two parents, singles arriving over time, a KV cache small enough to preempt: every
    step checked by the fake runner (what attention would read) and the invariants."""
    sched = make_scheduler(
        num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64, max_num_seqs=12,
        enable_prefix_caching=prefix_caching,
    )  # fmt: skip
    engine = FakeEngine(sched)
    shared = prompt_of("shared", 24)
    for i in range(16):
        engine.add(make_request(f"{i}_p", shared, max_tokens=12))
    for i in range(6):
        engine.add(make_request(f"{i}_r", shared[:8] + prompt_of("r", 20), max_tokens=9))
    schedules = []
    while engine.busy():
        if len(schedules) % 3 == 0 and len(schedules) < 30:
            n = len(schedules)
            engine.add(make_request(f"s{n}", shared[:12] + [n + 1], max_tokens=5))
        schedules.append(engine.step().num_scheduled_tokens)
        assert len(schedules) < 2000
    return engine, sched, schedules


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_are_the_same_with_preemption_and_prefix_caching(prefix_caching, monkeypatch):
    results, schedules = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MINIVLLM_FAIR_SHARE", flag)
        engine, sched, schedules[flag] = run_mix(num_blocks=40, prefix_caching=prefix_caching)
        assert sched.num_preemptions > 0  # the cache was small enough to preempt
        assert sched.kv_cache_manager.get_num_free_blocks() == 40  # every block came back
        results[flag] = (engine.outputs, engine.finish_reasons)
    assert schedules["1"] != schedules["0"]  # the rule changed the steps...
    assert results["1"] == results["0"]  # ...and no request's tokens
    outputs, _ = results["1"]
    assert all(len(tokens) == (12 if r.endswith("_p") else 9 if r.endswith("_r") else 5)
               for r, tokens in outputs.items())  # fmt: skip


def slo_scheduler() -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=SEQS, max_num_batched_tokens=BUDGET, max_model_len=1024, policy="slo"
    )
    sched = Scheduler(config, CacheConfig(block_size=16, enable_prefix_caching=False), 4096)
    model = StepTimeModel()
    model.load([0.010, 0.0, 0.0000001, 0.0015, 0.0])  # prompt tokens nearly free
    sched.policy = SLOPolicy(config, model, lambda: 1000.0)
    sched.waiting = sched.policy.make_waiting_queue()
    return sched


def test_the_slo_policy_keeps_the_fair_shares(fairness):
    sched = slo_scheduler()
    add_parent(sched, "p", 128, prompt_of("p", 100))
    so, _ = step(sched)
    assert so.total_num_scheduled_tokens == BUDGET
    sched.add_request(make_request("q", [1, 2, 3, 4, 5], max_tokens=4))
    so, _ = step(sched)
    assert ("q" in so.num_scheduled_tokens) == fairness


def test_the_slo_policy_never_cuts_a_latency_sensitive_decode():
    # 128 latency-sensitive children decode; a newcomer waits, and the parent's share (a
    # budget of 64 here) is below its 128 decodes: they all run, the newcomer beside them.
    sched = slo_scheduler()
    slo = SLOParams(True, tpot=10.0)
    for i in range(128):
        sched.add_request(make_request(f"{i}_p", [1, 2, 3], max_tokens=8, slo_params=slo))
    step(sched)
    sched.policy.fair_share.max_num_batched_tokens = 64
    sched.add_request(make_request("q", [4, 5, 6], max_tokens=4))
    so, _ = step(sched)
    assert sum(group_of(r) == "p" for r in so.num_scheduled_tokens) == 128
    assert so.num_scheduled_tokens["q"] == 3


def test_under_the_slo_policys_time_limit_a_newcomer_starts_in_the_next_step(fairness):
    # A default TTFT target keeps best-effort steps under half of it (25 ms): 10 of the
    # parent's sequences fit a step (10 ms + 1.5 ms a row), and the rest of its 128 waited
    # ahead of the newcomer until all had ended.
    config = SchedulerConfig(max_num_batched_tokens=BUDGET, policy="slo", default_slo_ttft=0.05)
    sched = Scheduler(config, CacheConfig(block_size=4), 4096)
    model = StepTimeModel()
    model.load([0.010, 0.0, 0.0005, 0.0015, 0.0])
    sched.policy = SLOPolicy(config, model, lambda: 1000.0)
    sched.waiting = sched.policy.make_waiting_queue()
    add_parent(sched, "p", 128, [1, 2, 3])
    for _ in range(3):
        assert len(step(sched)[0].num_scheduled_tokens) == 10
    sched.add_request(make_request("q", [4, 5, 6, 7, 8], max_tokens=4))
    so, _ = step(sched)
    assert ("q" in so.num_scheduled_tokens) == fairness
    assert sched.policy.predicted_time() <= 0.025
